//! A stream of chunks as a gRPC response body that sends each piece's bytes as they are.
//!
//! tonic encodes every response message into one buffer before it goes out: for a batch
//! stream that is a copy of every batch, and more copies as that buffer grows to the
//! message's size. Serving ready batches to one consumer, those copies were 38% of the
//! worker's CPU (`perf record --call-graph dwarf` on `stoker-worker bench serve` under
//! a Python client), CPU that belongs to preprocessing. Here a chunk becomes
//! its encoding's small parts (the gRPC message prefix, the header, each piece's key and
//! length, the closing fields), written into small buffers, with each piece's bytes in
//! between as the reference-counted slice of the batch it already is; HTTP/2 writes those
//! with vectored I/O, so the kernel's copy into the socket is the only one. The bytes on the
//! wire are prost's encoding of the chunk, exactly (tested below).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http::HeaderMap;
use http_body::Frame;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use stoker_api::proto::BatchChunk;
use tonic::Status;

/// Pieces shorter than this are copied into the parts around them: a separate buffer costs
/// more than copying a few hundred bytes.
const INLINE_PIECE: usize = 1024;

/// The chunks a Stream call answers with.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<BatchChunk, Status>> + Send>>;

/// The response body: the chunks' messages, then trailers with the call's status (OK at the
/// end of the stream, or the status of the first error, which ends it).
pub struct ChunkBody {
    chunks: ChunkStream,
    /// Parts of the message being sent, in order.
    parts: VecDeque<Bytes>,
    done: bool,
}

impl ChunkBody {
    pub fn new(chunks: ChunkStream) -> Self {
        ChunkBody { chunks, parts: VecDeque::new(), done: false }
    }
}

impl http_body::Body for ChunkBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        // The next chunk is pulled only once the last one's parts are all taken: HTTP/2 flow
        // control paces the pulls, and so the source (`stream.rs`, backpressure).
        loop {
            if let Some(part) = self.parts.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(part))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            let status = match ready!(self.chunks.poll_next_unpin(cx)) {
                Some(Ok(chunk)) => {
                    self.parts = message_parts(chunk);
                    continue;
                }
                Some(Err(status)) => status,
                None => Status::ok(""),
            };
            self.done = true;
            return Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.parts.is_empty()
    }
}

/// The trailers that carry `status`.
pub fn trailers(status: &Status) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    if let Err(unwritable) = status.add_header(&mut trailers) {
        // Only a message that cannot be a header value gets here; the code still can.
        trailers.clear();
        let _ = Status::new(status.code(), "").add_header(&mut trailers);
        tracing::warn!(error = %unwritable, "a status message could not be written as a trailer");
    }
    trailers
}

/// One gRPC message (an uncompressed flag, the length, the protobuf encoding) of `chunk` as
/// parts to send in order: small buffers of its fields with its pieces' bytes between them.
pub fn message_parts(mut chunk: BatchChunk) -> VecDeque<Bytes> {
    let len = chunk.encoded_len();
    let mut parts = VecDeque::with_capacity(2 * chunk.pieces.len() + 1);
    let mut head = BytesMut::with_capacity(64 + chunk.header.as_ref().map_or(0, Message::encoded_len));
    head.put_u8(0);
    // A chunk is within the client's message limit, at most 256 MiB (`proto::MAX_MAX_MESSAGE_BYTES`).
    head.put_u32(u32::try_from(len).expect("a chunk is at most the largest message limit"));
    // Fields in number order, as prost writes them: the header (1), the pieces (2), and what
    // the chunk encodes to without those two (last, shared_file, reuse_shared_file).
    if let Some(header) = chunk.header.take() {
        prost::encoding::message::encode(1, &header, &mut head);
    }
    for piece in std::mem::take(&mut chunk.pieces) {
        encode_key(2, WireType::LengthDelimited, &mut head);
        encode_varint(piece.len() as u64, &mut head);
        if piece.len() < INLINE_PIECE {
            head.put_slice(&piece);
        } else {
            parts.push_back(head.split().freeze());
            parts.push_back(piece);
        }
    }
    chunk.encode(&mut head).expect("a BytesMut grows as needed");
    if !head.is_empty() {
        parts.push_back(head.freeze());
    }
    parts
}

#[cfg(test)]
mod tests {
    use futures::stream;
    use http_body_util::BodyExt;
    use stoker_api::proto::{BatchHeader, TensorMeta};

    use super::*;

    fn piece(len: usize, seed: u8) -> Bytes {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<_>>().into()
    }

    fn header() -> BatchHeader {
        BatchHeader {
            epoch: 2,
            split: 9,
            sequence: 4,
            rows: vec![1 << 32, 1 << 32 | 7],
            tensors: vec![TensorMeta { name: "image".into(), dtype: 3, shape: vec![2, 4], byte_length: 8, layout: 0 }],
            ..Default::default()
        }
    }

    /// What tonic sends for `chunk`: the message prefix and prost's encoding.
    fn tonic_message(chunk: &BatchChunk) -> Vec<u8> {
        let encoded = chunk.encode_to_vec();
        let mut message = vec![0];
        message.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        message.extend_from_slice(&encoded);
        message
    }

    fn chunks() -> Vec<BatchChunk> {
        vec![
            BatchChunk::default(),
            BatchChunk { header: Some(header()), last: true, shared_file: "stoker-7".into(), ..Default::default() },
            BatchChunk { header: Some(header()), pieces: vec![piece(8, 1), piece(70_000, 2)], ..Default::default() },
            BatchChunk {
                pieces: vec![Bytes::new(), piece(1023, 3), piece(1024, 4), piece(300_000, 5), piece(3, 6)],
                last: true,
                reuse_shared_file: true,
                ..Default::default()
            },
        ]
    }

    #[test]
    fn a_chunks_parts_are_tonics_message_byte_for_byte() {
        for chunk in chunks() {
            let parts = message_parts(chunk.clone());
            assert_eq!(parts.iter().flatten().copied().collect::<Vec<u8>>(), tonic_message(&chunk), "{chunk:?}");
        }
    }

    #[test]
    fn large_pieces_go_out_as_the_batchs_own_bytes() {
        let big = piece(300_000, 5);
        let chunk = BatchChunk { pieces: vec![piece(10, 1), big.clone()], last: true, ..Default::default() };
        let parts = message_parts(chunk);
        assert_eq!(parts.len(), 3, "prefix with the small piece, the big piece, the closing field");
        assert_eq!(parts[1].as_ptr(), big.as_ptr(), "the big piece is not copied");
        assert_eq!(
            parts[0].len(),
            5 + 2 + 10 + 1 + 3,
            "prefix, small piece with key and length, big piece's key and length"
        );
    }

    #[tokio::test]
    async fn the_body_is_the_messages_then_an_ok_status() {
        let body = ChunkBody::new(Box::pin(stream::iter(chunks().into_iter().map(Ok))));
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers");
        assert_eq!(collected.to_bytes(), chunks().iter().flat_map(tonic_message).collect::<Vec<_>>());
        assert_eq!(Status::from_header_map(&trailers).unwrap().code(), tonic::Code::Ok);
    }

    #[tokio::test]
    async fn an_error_ends_the_body_with_its_status() {
        let items = vec![
            Ok(chunks().remove(2)),
            Err(Status::resource_exhausted("the header is too large")),
            Ok(chunks().remove(1)),
        ];
        let body = ChunkBody::new(Box::pin(stream::iter(items)));
        let collected = body.collect().await.unwrap();
        let status = Status::from_header_map(collected.trailers().unwrap()).unwrap();
        assert_eq!((status.code(), status.message()), (tonic::Code::ResourceExhausted, "the header is too large"));
        assert_eq!(collected.to_bytes(), tonic_message(&chunks()[2]), "nothing after the error");
    }
}
