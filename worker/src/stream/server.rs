//! The BatchStream server: tonic's generated one, except that an uncompressed Stream call is
//! answered with a [`ChunkBody`], which sends batches without copying them (`body.rs` says
//! why). Compressed calls, which need tonic's encoder, and every other path go to tonic.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use prost::Message;
use stoker_api::proto::StreamRequest;
use stoker_api::proto::batch_stream_server::{BatchStream, BatchStreamServer};
use tonic::codegen::{BoxFuture, Service, StdError, http};
use tonic::metadata::{GRPC_CONTENT_TYPE, MetadataMap};
use tonic::server::NamedService;
use tonic::{Request, Status};

use super::body::ChunkBody;
use super::{Authenticator, BatchSource, StreamService};

const STREAM_PATH: &str = "/stoker.v1alpha1.BatchStream/Stream";
/// The largest StreamRequest read. Its names are at most 253 bytes each, so a real one is
/// under 2 KiB; tonic's default of 4 MiB would let any caller make the worker buffer that.
const MAX_REQUEST_BYTES: usize = 64 << 10;

pub struct StreamServer<S, A> {
    service: Arc<StreamService<S, A>>,
    tonic: BatchStreamServer<StreamService<S, A>>,
}

impl<S, A> Clone for StreamServer<S, A> {
    fn clone(&self) -> Self {
        StreamServer { service: self.service.clone(), tonic: self.tonic.clone() }
    }
}

impl<S: BatchSource, A: Authenticator> StreamServer<S, A> {
    pub fn new(service: StreamService<S, A>) -> Self {
        let compression = service.compression;
        let service = Arc::new(service);
        let mut tonic = BatchStreamServer::from_arc(service.clone());
        if let Some(encoding) = compression {
            tonic = tonic.send_compressed(encoding).accept_compressed(encoding);
        }
        StreamServer { service, tonic }
    }

    /// Whether this server answers the call itself: a Stream call that is not compressed
    /// either way.
    fn answers<B>(&self, request: &http::Request<B>) -> bool {
        let identity = request.headers().get("grpc-encoding").is_none_or(|e| e == "identity");
        request.uri().path() == STREAM_PATH && self.service.compression.is_none() && identity
    }
}

impl<S: BatchSource, A: Authenticator> NamedService for StreamServer<S, A> {
    const NAME: &'static str = <BatchStreamServer<StreamService<S, A>> as NamedService>::NAME;
}

impl<S, A, B> Service<http::Request<B>> for StreamServer<S, A>
where
    S: BatchSource,
    A: Authenticator,
    B: http_body::Body<Data: Send> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if !self.answers(&request) {
            return self.tonic.call(request);
        }
        let service = self.service.clone();
        Box::pin(async move { Ok(stream(&service, request).await.unwrap_or_else(Status::into_http)) })
    }
}

async fn stream<S: BatchSource, A: Authenticator, B>(
    service: &StreamService<S, A>,
    request: http::Request<B>,
) -> Result<http::Response<tonic::body::Body>, Status>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let (parts, body) = request.into_parts();
    let message = read_request(body).await?;
    let request = Request::from_parts(MetadataMap::from_headers(parts.headers), parts.extensions, message);
    let (metadata, chunks, _) = service.stream(request).await?.into_parts();
    let mut response = http::Response::new(tonic::body::Body::new(ChunkBody::new(chunks)));
    *response.headers_mut() = metadata.into_headers();
    response.headers_mut().insert(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE);
    Ok(response)
}

/// The call's one request message, with the statuses tonic gives the same faults.
async fn read_request<B>(body: B) -> Result<StreamRequest, Status>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let mut body = std::pin::pin!(body);
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Status::internal(format!("protocol error reading the request: {}", e.into())))?;
        if let Ok(data) = frame.into_data() {
            read.put(data);
        }
        if read.len() > 5 + MAX_REQUEST_BYTES {
            break;
        }
    }
    message(read.freeze())
}

/// The StreamRequest in one gRPC message's bytes.
fn message(mut read: Bytes) -> Result<StreamRequest, Status> {
    if read.is_empty() {
        return Err(Status::internal("Missing request message."));
    }
    if read.len() < 5 {
        return Err(Status::internal("unexpected EOF: the request's message prefix is cut short"));
    }
    let flag = read.get_u8();
    if flag != 0 {
        return Err(Status::internal(format!(
            "protocol error: compression flag {flag} on a request that names no grpc-encoding"
        )));
    }
    let len = read.get_u32() as usize;
    if len > MAX_REQUEST_BYTES {
        return Err(Status::out_of_range(format!(
            "the request message is {len} bytes, over the {MAX_REQUEST_BYTES}-byte limit"
        )));
    }
    if read.len() < len {
        return Err(Status::internal(format!(
            "unexpected EOF: the request message has {} of its {len} bytes",
            read.len()
        )));
    }
    if read.len() > len {
        return Err(Status::internal("protocol error: a Stream call takes one request message"));
    }
    StreamRequest::decode(read).map_err(|e| Status::internal(format!("failed to decode the StreamRequest: {e}")))
}

#[cfg(test)]
mod tests {
    use tonic::codec::CompressionEncoding;

    use super::*;

    fn framed(flag: u8, len: u32, payload: &[u8]) -> Bytes {
        let mut b = vec![flag];
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(payload);
        b.into()
    }

    #[test]
    fn only_uncompressed_stream_calls_are_answered_here() {
        let source = || crate::stream::SyntheticSource::new(Vec::new());
        let plain = StreamServer::new(StreamService::new(source()));
        let compressing = StreamServer::new(StreamService::new(source()).with_compression(CompressionEncoding::Gzip));
        let call = |path: &str, encoding: Option<&str>| {
            let mut request = http::Request::post(path);
            if let Some(encoding) = encoding {
                request = request.header("grpc-encoding", encoding);
            }
            request.body(()).unwrap()
        };
        assert!(plain.answers(&call(STREAM_PATH, None)));
        assert!(plain.answers(&call(STREAM_PATH, Some("identity"))));
        assert!(!plain.answers(&call(STREAM_PATH, Some("gzip"))), "tonic refuses what it cannot decode");
        assert!(!plain.answers(&call("/stoker.v1alpha1.BatchStream/Nope", None)));
        assert!(!compressing.answers(&call(STREAM_PATH, None)), "tonic's encoder compresses");
    }

    #[test]
    fn a_request_message_is_read_or_refused_as_tonic_would() {
        let request = StreamRequest { job: "j".into(), consumer_index: 3, ..Default::default() };
        let encoded = request.encode_to_vec();
        let len = encoded.len() as u32;
        assert_eq!(message(framed(0, len, &encoded)).unwrap(), request);
        let refused = |bytes: Bytes| message(bytes).unwrap_err();
        assert_eq!(refused(Bytes::new()).message(), "Missing request message.");
        assert!(refused(framed(0, len, &encoded[..2])).message().contains("EOF"));
        assert!(refused(framed(0, len, &encoded).slice(..3)).message().contains("EOF"));
        assert!(refused(framed(1, len, &encoded)).message().contains("protocol error"));
        let twice = [framed(0, len, &encoded), framed(0, len, &encoded)].concat();
        assert!(refused(twice.into()).message().contains("one request message"));
        assert_eq!(refused(framed(0, u32::MAX, &encoded)).code(), tonic::Code::OutOfRange);
        let garbage = framed(0, 3, &[0xff, 0xff, 0xff]);
        assert!(refused(garbage).message().contains("decode"));
    }
}
