//! Hot loops compiled twice: for AVX2, run where the CPU has it, and as built. The build
//! targets baseline x86-64 so the binary runs anywhere, but baseline SSE2 leaves the compiler
//! without 32-bit vector multiplies and 256-bit shuffles, and some loops run several times
//! faster with them (the resize filter; the planar layout for the python op).

/// `fn name(args) -> ret = inner;` defines `name`, which calls `inner` (an `#[inline(always)]`
/// function) compiled with AVX2 enabled when the CPU supports it, else as built. Both run the
/// same code, so the results are the same.
macro_rules! dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $inner:path;) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $inner($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $inner($($arg),*)
        }
    };
}

pub(crate) use dispatch;
