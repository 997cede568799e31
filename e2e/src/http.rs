//! A minimal plain-HTTP GET for loopback endpoints (etcd's /health, the operator's /healthz,
//! /readyz and /metrics), so the harness needs no HTTP client library.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A response: status code and body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    /// An operator's /readyz answer says it leads (a standby answers 200 "standby").
    pub fn says_leading(&self) -> bool {
        self.status == 200 && self.body.trim() == "leading"
    }

    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// `GET http://{addr}{path}` with HTTP/1.0 (the server closes the connection after the body).
pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<Response> {
    let work = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        parse(&raw)
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| anyhow!("GET http://{addr}{path} timed out"))?
        .with_context(|| format!("GET http://{addr}{path}"))
}

fn parse(raw: &[u8]) -> anyhow::Result<Response> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| anyhow!("malformed HTTP response: {text:?}"))?;
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("malformed HTTP status line: {status_line:?}"))?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked { dechunk(body) } else { body.to_string() };
    Ok(Response { status, body })
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16) else { break };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let r = parse(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 7\r\n\r\nstandby").unwrap();
        assert_eq!((r.status, r.body.as_str()), (503, "standby"));
        let r =
            parse(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "abcde"));
    }
}
