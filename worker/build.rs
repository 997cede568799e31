//! Builds the libjpeg-turbo shim (src/ops/jpeg/turbo.c) and links libjpeg-turbo statically,
//! so the worker binary runs on a base image without it (distroless). Debian:
//! `apt-get install libjpeg62-turbo-dev` (`make tools` does).

fn main() {
    println!("cargo:rerun-if-changed=src/ops/jpeg/turbo.c");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    let headers = ["/usr/include/jpeglib.h".to_string(), format!("/usr/include/{arch}-linux-gnu/jpeglib.h")];
    if std::env::var_os("STOKER_LIBJPEG_DIR").is_none() && !headers.iter().any(|h| std::path::Path::new(h).exists()) {
        panic!(
            "libjpeg-turbo's development files are missing (no jpeglib.h): `make deps`, or \
             `apt-get install libjpeg62-turbo-dev`"
        );
    }
    cc::Build::new().file("src/ops/jpeg/turbo.c").opt_level(2).warnings(true).compile("stoker_turbo");
    // Debian's multiarch directory for the target, unless STOKER_LIBJPEG_DIR names another.
    let dir = std::env::var("STOKER_LIBJPEG_DIR").unwrap_or_else(|_| format!("/usr/lib/{arch}-linux-gnu"));
    println!("cargo:rerun-if-env-changed=STOKER_LIBJPEG_DIR");
    println!("cargo:rustc-link-search=native={dir}");
    println!("cargo:rustc-link-lib=static=jpeg");
}
