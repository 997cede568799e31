//! What the fuzz targets share (the worker's include this file too): a counting allocator to
//! see how much memory a call takes and keeps, the case count, and gRPC calls made of raw bytes.

#![allow(dead_code)] // each target uses a different part

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// Cases each target runs by default: together the fuzz targets stay within about a minute in
/// a debug build on two cores. `STOKER_FUZZ_CASES` runs more (or fewer) by hand.
/// Held by each test of a fuzz binary: the allocation counters are process-wide, so a test
/// measuring its peak must not run beside another allocating test.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub fn cases(default: u32) -> u32 {
    std::env::var("STOKER_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Counts live heap bytes and their peak. Install with `#[global_allocator]`.
pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Any single allocation above this is refused: nothing a handler does for one message of at
/// most 4 MiB needs it, so it can only be a request field sizing an allocation. Refusing makes
/// the test abort naming the size (`memory allocation of N bytes failed`) instead of the
/// machine, shared with others, swapping.
pub const LARGEST_ALLOCATION: usize = 256 << 20;

fn grew(by: usize) {
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call forwards to the system allocator with the caller's layout; the counters
// are only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LARGEST_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires it.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LARGEST_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as GlobalAlloc::alloc_zeroed requires it.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: a pointer this allocator (the system's) gave for this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > LARGEST_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: a pointer this allocator (the system's) gave for this layout.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

/// Live heap bytes now.
pub fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Starts measuring a peak from now.
pub fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

/// The most live heap bytes since `reset_peak`.
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// A gRPC message frame: not compressed, the payload's length, the payload.
pub fn frame(payload: &[u8]) -> Bytes {
    framed(0, payload.len() as u32, payload)
}

/// A frame with any flag and length prefix, true or not.
pub fn framed(flag: u8, len: u32, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flag);
    b.put_u32(len);
    b.put_slice(payload);
    b.freeze()
}

/// How a server answered a raw call.
#[derive(Debug)]
pub struct Answer {
    /// `grpc-status`.
    pub code: i32,
    pub message: String,
    /// Response messages' bytes seen before giving up on a stream that goes on.
    pub data: usize,
}

/// An HTTP/2 connection speaking gRPC with whatever bytes a test makes up, framing included.
pub struct Raw {
    addr: SocketAddr,
    send: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
}

impl Raw {
    pub async fn connect(addr: SocketAddr) -> Raw {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connecting to the server");
        // Headers and body go out in separate writes: with Nagle each call would wait for a
        // delayed ACK (40 ms).
        stream.set_nodelay(true).expect("TCP_NODELAY");
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("an HTTP/2 handshake");
        tokio::spawn(conn);
        Raw { addr, send }
    }

    /// POSTs `body` to `path` as a gRPC request and reads the status: from the headers of a
    /// trailers-only answer, else from the trailers; a stream that goes on (a valid
    /// WatchWorkers or Stream) is left after its first message, as OK. A connection the
    /// server dropped is an error: a handler that panicked, or a server that gave up.
    pub async fn call(&mut self, path: &str, body: Bytes) -> Result<Answer, String> {
        if self.send.is_closed() {
            *self = Raw::connect(self.addr).await;
        }
        let request = hyper::Request::post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Full::new(body))
            .expect("a request");
        // A bound on a hang, not a wait for something to happen: every answer comes at once.
        let answered = tokio::time::timeout(Duration::from_secs(20), async {
            self.send.ready().await.map_err(|e| format!("connection lost: {e}"))?;
            let response = self.send.send_request(request).await.map_err(|e| format!("no response: {e}"))?;
            if let Some(answer) = status_of(response.headers(), 0) {
                return Ok(answer);
            }
            let mut body = response.into_body();
            let mut data = 0;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| format!("the response broke off: {e}"))?;
                match frame.into_data() {
                    Ok(d) => {
                        data += d.len();
                        return Ok(Answer { code: 0, message: String::new(), data });
                    }
                    Err(frame) => {
                        if let Some(answer) = frame.trailers_ref().and_then(|t| status_of(t, data)) {
                            return Ok(answer);
                        }
                    }
                }
            }
            Err("the response ended without a grpc-status".to_string())
        })
        .await;
        answered.unwrap_or_else(|_| Err(format!("no answer to {path} within 20 s")))
    }
}

fn status_of(headers: &hyper::HeaderMap, data: usize) -> Option<Answer> {
    let code = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    let message =
        headers.get("grpc-message").map(|m| percent_decode(m.to_str().unwrap_or_default())).unwrap_or_default();
    Some(Answer { code, message, data })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a raw call's answer is one a server may give to bytes it could not use: an error
/// status saying what was wrong (tonic answers INTERNAL for bytes that are not the message
/// and for broken framing, as the gRPC spec asks), or a valid answer. UNKNOWN (a handler that
/// panicked) and an INTERNAL that is not about decoding are not.
pub fn acceptable(answer: &Answer) -> bool {
    use tonic::Code;
    match Code::from_i32(answer.code) {
        Code::Ok
        | Code::InvalidArgument
        | Code::NotFound
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::ResourceExhausted
        | Code::Unimplemented => true,
        Code::Internal => {
            ["decode", "EOF", "protocol error", "Missing request message"].iter().any(|m| answer.message.contains(m))
        }
        _ => false,
    }
}
