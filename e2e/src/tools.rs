//! Where the external tools are, and running them.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use tokio::io::AsyncWriteExt as _;

/// The directory `make tools` (e2e/cluster/install-tools.sh) installs binaries into:
/// `$STOKER_BIN_DIR`, else `$STOKER_CACHE/bin`, else `~/.cache/stoker/bin`.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STOKER_BIN_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(cache) = std::env::var_os("STOKER_CACHE") {
        return PathBuf::from(cache).join("bin");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/stoker/bin")
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Finds a tool in [`bin_dir`] first, then on PATH; `None` when it is nowhere.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let candidate = bin_dir().join(name);
    if is_executable(&candidate) {
        return Some(candidate);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| is_executable(p))
}

/// Like [`find_tool`], but an error that says how to get it.
pub fn tool(name: &str) -> anyhow::Result<PathBuf> {
    find_tool(name).ok_or_else(|| {
        anyhow!(
            "`{name}` was found neither in {} nor on PATH: run `make tools` (bash e2e/cluster/install-tools.sh)",
            bin_dir().display()
        )
    })
}

/// The workspace root (the directory with the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` (relative to the workspace root) or
/// `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// A binary of this workspace, built by `cargo build --workspace --bins`.
/// `$STOKER_<NAME>_BIN` (e.g. `STOKER_OPERATOR_BIN` for `stoker-operator`) overrides the path.
pub fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    let var = format!("{}_BIN", name.to_uppercase().replace('-', "_"));
    if let Some(path) = std::env::var_os(&var) {
        let path = PathBuf::from(path);
        if !is_executable(&path) {
            bail!("${var} = {} is not an executable file", path.display());
        }
        return Ok(path);
    }
    let path = target_dir().join("debug").join(name);
    if !is_executable(&path) {
        bail!("{} is missing: build it first with `cargo build --workspace --bins` (or set ${var})", path.display());
    }
    Ok(path)
}

/// A binary as built for the cluster's images by `e2e/cluster/images.sh`: from `target/debug`
/// when `STOKER_IMAGE_PROFILE=dev` (what `make test` does), else from `target/release`.
pub fn image_binary(name: &str) -> anyhow::Result<PathBuf> {
    let profile = match std::env::var("STOKER_IMAGE_PROFILE").as_deref() {
        Ok("dev") => "debug",
        Ok("release") | Err(_) => "release",
        Ok(other) => bail!("STOKER_IMAGE_PROFILE is release or dev, not {other:?}"),
    };
    let path = target_dir().join(profile).join(name);
    if !is_executable(&path) {
        bail!("{} is missing: e2e/cluster/images.sh builds it with the images", path.display());
    }
    Ok(path)
}

/// The output of a finished command.
#[derive(Debug, Clone)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
}

/// One invocation of an external program: arguments, environment, optional stdin, a timeout.
pub struct Cmd {
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    stdin: Option<Vec<u8>>,
    cwd: Option<PathBuf>,
    timeout: Duration,
}

impl Cmd {
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Cmd {
            program: program.into(),
            args: Vec::new(),
            envs: Vec::new(),
            stdin: None,
            cwd: None,
            timeout: Duration::from_secs(300),
        }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_string_lossy().into_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_string_lossy().into_owned()));
        self
    }

    pub fn env(mut self, key: impl Into<String>, value: impl AsRef<OsStr>) -> Self {
        self.envs.push((key.into(), value.as_ref().to_string_lossy().into_owned()));
        self
    }

    pub fn stdin(mut self, input: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(input.into());
        self
    }

    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The command line, for messages.
    pub fn display(&self) -> String {
        let name = self.program.file_name().unwrap_or(self.program.as_os_str()).to_string_lossy();
        std::iter::once(name.into_owned()).chain(self.args.iter().map(|a| shell_quote(a))).collect::<Vec<_>>().join(" ")
    }

    /// Runs to completion; an error (with stderr) when it exits non-zero or times out.
    pub async fn run(self) -> anyhow::Result<Output> {
        let display = self.display();
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(if self.stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(dir) = &self.cwd {
            cmd.current_dir(dir);
        }
        let mut child = cmd.spawn().with_context(|| format!("starting `{display}`"))?;
        if let Some(input) = self.stdin {
            let mut stdin = child.stdin.take().expect("stdin is piped");
            tokio::spawn(async move {
                let _ = stdin.write_all(&input).await;
            });
        }
        let out = match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Ok(out) => out.with_context(|| format!("waiting for `{display}`"))?,
            Err(_) => bail!("`{display}` did not finish within {:?}", self.timeout),
        };
        let output = Output {
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        if !out.status.success() {
            let detail = if output.stderr.trim().is_empty() { output.stdout.trim() } else { output.stderr.trim() };
            bail!("`{display}` failed ({}):\n{detail}", out.status);
        }
        Ok(output)
    }

    /// Runs to completion and returns stdout.
    pub async fn stdout(self) -> anyhow::Result<String> {
        Ok(self.run().await?.stdout)
    }
}

fn shell_quote(arg: &str) -> String {
    if !arg.is_empty() && arg.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c)) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// The last `lines` lines of a (log) file, or a note that it cannot be read.
pub fn tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Random hex from the kernel, for tokens and names.
pub fn random_hex(bytes: usize) -> String {
    use std::io::Read as _;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).expect("reading /dev/urandom");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}
