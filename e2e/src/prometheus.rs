//! A real Prometheus (Debian's `prometheus` package, installed by `make tools`) on a loopback
//! port, scraping the targets the test names every second, and its query API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::process::ManagedProcess;
use crate::wait::{Check, wait_for};

pub struct Prometheus {
    _process: ManagedProcess,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    /// Starts Prometheus with its data and configuration in `dir`, scraping each job of
    /// `jobs` at the targets [`Prometheus::set_targets`] gives it; waits until it is ready.
    pub async fn start(dir: &Path, jobs: &[&str]) -> anyhow::Result<Self> {
        let binary = crate::tools::tool("prometheus")?;
        std::fs::create_dir_all(dir.join("data"))?;
        // Series keep their own namespace label (the pipeline's), as the chart's monitors do.
        let mut config = String::from("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n");
        for job in jobs {
            let file = dir.join(format!("{job}.json"));
            std::fs::write(&file, "[]")?;
            config.push_str(&format!(
                "  - job_name: {job}\n    honor_labels: true\n    scrape_timeout: 1s\n    \
                 file_sd_configs: [{{files: ['{}'], refresh_interval: 1s}}]\n",
                file.display()
            ));
        }
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config)?;
        let addr = crate::ports::free_addr();
        let args = [
            format!("--config.file={}", config_file.display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address={addr}"),
            "--log.level=warn".to_string(),
        ];
        let process = ManagedProcess::spawn("prometheus", &binary, &args, &[], &dir.join("prometheus.log"))?;
        let prometheus = Prometheus { _process: process, addr, dir: dir.to_path_buf() };
        wait_for(Duration::from_secs(60), "Prometheus to be ready", || async {
            Ok(match crate::http::get(addr, "/-/ready").await {
                Ok(r) if r.is_success() => Check::Done(()),
                Ok(r) => Check::not_yet(format!("{} {}", r.status, r.body.trim())),
                Err(e) => Check::not_yet(format!("{e:#}")),
            })
        })
        .await?;
        Ok(prometheus)
    }

    /// Sets what `job` scrapes (written whole, then renamed, so Prometheus never reads half).
    pub fn set_targets(&self, job: &str, targets: &[SocketAddr]) -> anyhow::Result<()> {
        let targets: Vec<String> = targets.iter().map(ToString::to_string).collect();
        let text = serde_json::json!([{ "targets": targets }]).to_string();
        let file = self.dir.join(format!("{job}.json"));
        let staging = file.with_extension("json.new");
        std::fs::write(&staging, text)?;
        std::fs::rename(&staging, &file)?;
        Ok(())
    }

    /// The instant vector `promql` evaluates to now; an error if Prometheus refuses it.
    pub async fn query(&self, promql: &str) -> anyhow::Result<Vec<Value>> {
        let path = format!("/api/v1/query?query={}", percent_encode(promql));
        let response = crate::http::get(self.addr, &path).await?;
        let body: Value = serde_json::from_str(&response.body)
            .with_context(|| format!("Prometheus answered {}: {}", response.status, response.body))?;
        if body["status"] != "success" {
            bail!("Prometheus refused {promql}: {}", body["error"]);
        }
        Ok(body["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The health of each scrape target, as `job address: health (last error)`.
    pub async fn targets(&self) -> anyhow::Result<Vec<String>> {
        let response = crate::http::get(self.addr, "/api/v1/targets").await?;
        let body: Value = serde_json::from_str(&response.body)?;
        Ok(body["data"]["activeTargets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                format!(
                    "{} {}: {} {}",
                    t["labels"]["job"].as_str().unwrap_or("?"),
                    t["scrapeUrl"].as_str().unwrap_or("?"),
                    t["health"].as_str().unwrap_or("?"),
                    t["lastError"].as_str().unwrap_or("")
                )
            })
            .collect())
    }
}

/// Everything but RFC 3986's unreserved characters as %XX.
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn queries_are_percent_encoded() {
        assert_eq!(super::percent_encode(r#"a{b="c d"}[1m]"#), "a%7Bb%3D%22c%20d%22%7D%5B1m%5D");
    }
}
