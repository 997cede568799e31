//! One worker's batch stream: opening it, and reading its chunks into the client's queue.
//! Used alike for a fixed list of workers and for the ones the dispatcher names.

use stoker_api::Batch;
use stoker_api::proto::batch_stream_client::BatchStreamClient;
use stoker_api::proto::{self, BatchChunk, PipelineRef, StreamRequest};
use stoker_api::token::TokenSource;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use crate::delivery::Delivery;
use crate::error::Error;
use crate::options::ClientOptions;
use crate::reassemble::Reassembler;
use crate::tls::WorkerTls;

/// Opens a worker's stream: of one `epoch` under the dispatcher, else from `start_epoch` on;
/// over TLS as `tls` says, with the client's one `token` source.
pub(crate) async fn open(
    worker: &str,
    (options, token): (&ClientOptions, &TokenSource),
    epoch: Option<u64>,
    tls: &WorkerTls,
) -> Result<tonic::Streaming<BatchChunk>, Error> {
    let connect = |source| Error::Connect { worker: worker.to_string(), source };
    let (uri, tls) = crate::tls::worker(worker, options, tls)?;
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(connect)?
        .connect_timeout(options.connect_timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(options.stream_window_bytes)
        .initial_connection_window_size(options.stream_window_bytes.saturating_mul(2));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(connect)?;
    }
    let channel: Channel = endpoint
        .connect()
        .await
        .map_err(|source| crate::tls::failure(worker, &source).unwrap_or_else(|| connect(source)))?;
    let mut client = BatchStreamClient::new(channel).max_decoding_message_size(options.max_message_bytes);
    if let Some(encoding) = options.compression {
        client = client.accept_compressed(encoding);
    }
    let mut request = tonic::Request::new(StreamRequest {
        pipeline: Some(PipelineRef { namespace: options.namespace.clone(), name: options.pipeline.clone() }),
        job: options.job.clone(),
        consumer_index: options.consumer_index,
        consumers: options.consumers,
        coordinated: options.coordinated,
        start_epoch: options.start_epoch,
        max_message_bytes: options.max_message_bytes as u64,
        epoch,
        // Batches through shared memory are for the Python client.
        shared_memory: None,
    });
    if let Some(token) = &options.token {
        proto::bearer(token)
            .parse::<tonic::metadata::MetadataValue<_>>()
            .map_err(|_| Error::InvalidOptions("the token is not a valid header value".into()))?;
    }
    token.attach(&mut request);
    let status = |s: tonic::Status| {
        crate::tls::failure(worker, &s)
            .unwrap_or_else(|| Error::Status { worker: worker.to_string(), status: Box::new(s) })
    };
    Ok(client.stream(request).await.map_err(status)?.into_inner())
}

/// Reads one worker's chunks into the shared queue. Waiting on the full queue stops reading the
/// stream, which stops HTTP/2 window updates, which stops the worker: that is the backpressure.
/// Under the dispatcher, `delivery` records each batch's rows as it enters the queue.
/// Returns why the stream failed, or None when it ended or the client is gone.
pub(crate) async fn pump(
    worker: String,
    mut stream: tonic::Streaming<BatchChunk>,
    tx: &mpsc::Sender<Result<Batch, Error>>,
    max_batch_bytes: u64,
    delivery: Option<&Delivery>,
    mut on_batch: impl FnMut(),
) -> Option<Error> {
    let mut reassembler = Reassembler::new(max_batch_bytes);
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => match reassembler.push(chunk) {
                Ok(Some(batch)) => {
                    // Undone if the stream is stopped (its worker left the list) before the
                    // batch is in: only queued rows count as delivered.
                    let recorded = match delivery.map(|d| d.record(&worker, &batch)) {
                        // Made under a dispatcher this client rejoined another after.
                        Some(None) => continue,
                        recorded => recorded.flatten(),
                    };
                    let data = (!batch.is_completions()).then(|| (batch.epoch, batch.round.clone()));
                    if data.is_some() {
                        on_batch();
                    }
                    let Ok(room) = tx.reserve().await else {
                        return None; // the client is gone
                    };
                    // Made under a dispatcher a rejoin retired while it waited for room.
                    if recorded.is_some_and(|r| !r.keep()) {
                        continue;
                    }
                    room.send(Ok(batch));
                    if let (Some(d), Some((epoch, round))) = (delivery, data) {
                        d.received(epoch, round.as_ref());
                    }
                }
                Ok(None) => {}
                Err(source) => return Some(Error::Protocol { worker, source }),
            },
            Ok(None) => return reassembler.finish().err().map(|source| Error::Protocol { worker, source }),
            Err(status) => return Some(Error::Status { worker, status: Box::new(status) }),
        }
    }
}
