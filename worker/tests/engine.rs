//! The engine end to end on real files: sources, formats, transforms, shuffle, batching,
//! corrupt records, and backpressure.

use std::sync::mpsc::{Receiver, sync_channel};
use std::time::Duration;

use stoker_api::{Batch, DType, WorkerPipeline};
use stoker_worker::corpus::{CorpusSpec, generate, resnet50_train};
use stoker_worker::engine::{Assigned, Engine, EngineConfig, EngineError, Ready};

fn corpus(images: usize, classes: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    generate(dir.path(), &CorpusSpec { images, classes, min_side: 250, max_side: 300, ..Default::default() }).unwrap();
    dir
}

fn uri(dir: &std::path::Path) -> String {
    format!("file://{}/", dir.display())
}

/// Runs one epoch on a blocking thread and collects every batch.
async fn epoch(pipeline: WorkerPipeline, config: EngineConfig) -> Result<(Vec<Batch>, Engine), EngineError> {
    let engine = Engine::open(pipeline, config).await?;
    let (tx, rx) = sync_channel(2);
    let producer = tokio::task::spawn_blocking(move || engine.run_epoch(0, &tx).map(|()| engine));
    let batches = tokio::task::spawn_blocking(move || collect(rx)).await.unwrap();
    let engine = producer.await.unwrap()?;
    Ok((batches, engine))
}

/// Runs every split of epoch 0 as a dispatcher hands them out: the batches made, and the
/// splits left for the worker to report itself.
async fn run_dispatched(engine: Engine) -> (Vec<Ready>, Vec<u64>) {
    let (tx, rx) = sync_channel(64);
    let leftover = tokio::task::spawn_blocking(move || {
        let splits: Vec<_> = engine.mix().epoch(0).into_iter().map(Assigned::whole).collect();
        engine.run_splits(0, splits, &tx)
    })
    .await
    .unwrap()
    .unwrap();
    (rx.iter().collect(), leftover)
}

fn collect(rx: Receiver<Ready>) -> Vec<Batch> {
    rx.iter().map(|r| r.batch.join()).collect()
}

/// A tensor's int64 values.
fn int64s(t: &stoker_api::Tensor) -> Vec<i64> {
    t.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Every `x` of every batch, sorted.
fn sorted_xs(rx: Receiver<Ready>) -> Vec<i64> {
    let mut xs: Vec<i64> = collect(rx).iter().flat_map(|b| int64s(&b.tensors["x"])).collect();
    xs.sort_unstable();
    xs
}

/// Waits (30 s at most) until `done`, which says what is awaited when it does not come.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let since = std::time::Instant::now();
    while !done() {
        assert!(since.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What a worker's share groups did: productions made, rows taken from copies, copies made
/// again.
fn shared_counts(engine: &Engine) -> (u64, u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    let stats = &engine.shared.stats;
    (stats.made.load(Relaxed), stats.rows_taken.load(Relaxed), stats.made_again.load(Relaxed))
}

/// `files` JSONL files of `lines` records each, file `f`'s `x` running from `f * stride`.
fn jsonl_files(files: i64, lines: i64, stride: i64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in 0..files {
        let text: String = (0..lines).map(|i| format!("{{\"x\": {}}}\n", file * stride + i)).collect();
        std::fs::write(dir.path().join(format!("{file}.jsonl")), text).unwrap();
    }
    dir
}

/// A JSONL pipeline over the files in `dir`, batches of `batch`, nothing else.
fn jsonl_spec(dir: &std::path::Path, batch: usize) -> stoker_api::DataPipelineSpec {
    stoker_api::from_yaml(&format!("source: {{uri: '{}', format: jsonl}}\nbatchSize: {batch}\n", uri(dir))).unwrap()
}

fn config(threads: usize) -> EngineConfig {
    EngineConfig { threads, files_per_split: 8, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread")]
async fn resnet_transforms_over_an_image_folder() {
    let dir = corpus(20, 2);
    let (batches, engine) = epoch(resnet50_train(&uri(dir.path()), 8), config(2)).await.unwrap();
    let sizes: Vec<usize> = batches.iter().map(|b| b.tensors["image"].shape[0]).collect();
    assert_eq!(sizes, [8, 8, 4], "20 images in batches of 8, remainder kept");
    let image = &batches[0].tensors["image"];
    assert_eq!((image.dtype, image.shape.clone()), (DType::Float32, vec![8, 224, 224, 3]));
    let label = &batches[0].tensors["label"];
    assert_eq!((label.dtype, label.shape.clone()), (DType::Int64, vec![8]));
    let labels: Vec<i64> = batches
        .iter()
        .flat_map(|b| {
            b.tensors["label"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(labels.iter().filter(|&&l| l == 0).count(), 10);
    assert_eq!(labels.iter().filter(|&&l| l == 1).count(), 10);
    assert_eq!(engine.stats.elements.load(std::sync::atomic::Ordering::Relaxed), 20);
    let ops = engine.stats.ops.lock().unwrap().clone();
    let op_time: Vec<_> = ops.iter().map(|t| t.time).collect();
    // The flip and the normalize are folded into the crop's writing, and timed as part of it.
    assert!(op_time[..2].iter().all(|t| !t.is_zero()) && op_time[2..].iter().all(|t| t.is_zero()), "{op_time:?}");
    // Each op, folded or not, counts every image in and out.
    assert!(ops.iter().all(|t| (t.elements_in, t.elements_out) == (20, 20)), "{ops:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_repeats_exactly_whatever_the_thread_count() {
    let dir = corpus(12, 3);
    let mut pipeline = resnet50_train(&uri(dir.path()), 4);
    pipeline.data_plane.shuffle = Some(stoker_api::Shuffle { buffer_size: 6, seed: None });
    let (one, _) = epoch(pipeline.clone(), config(1)).await.unwrap();
    let (two, _) = epoch(pipeline.clone(), config(2)).await.unwrap();
    assert_eq!(one, two, "same seed: same batches, same bytes");
    pipeline.data_plane.seed = Some(99);
    let (other, _) = epoch(pipeline, config(2)).await.unwrap();
    assert_ne!(one[0].tensors["image"].data, other[0].tensors["image"].data, "another seed crops differently");
}

#[tokio::test(flavor = "multi_thread")]
async fn jsonl_with_corrupt_lines_filters_and_renames() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.jsonl"),
        "{\"x\": 1, \"y\": 0.5, \"t\": \"a\"}\nnot json\n{\"x\": 5, \"y\": 1.5, \"t\": \"b\"}\n{\"x\": 9, \"y\": 2.5, \"t\": \"c\"}\n",
    )
    .unwrap();
    let manifest = format!(
        "source: {{uri: '{}', format: jsonl}}\nbatchSize: 8\ntransforms:\n- filter: {{field: x, op: gt, value: '2'}}\n\
         - selectFields: {{fields: [x, y]}}\n- renameFields: {{mapping: {{y: weight}}}}\n",
        uri(dir.path())
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let pipeline = WorkerPipeline::new("ns", "jsonl", &spec);
    let (batches, engine) = epoch(pipeline.clone(), config(2)).await.unwrap();
    assert_eq!(batches.len(), 1);
    let b = &batches[0];
    assert_eq!(b.tensors.keys().collect::<Vec<_>>(), ["weight", "x"]);
    let xs: Vec<i64> = b.tensors["x"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(xs, [5, 9], "x > 2 kept, in order");
    assert_eq!(engine.stats.skipped().get("bad_json"), Some(&1), "the corrupt line is counted");
    assert_eq!(engine.stats.filtered.load(std::sync::atomic::Ordering::Relaxed), 1);
    let counts: Vec<_> = engine.stats.ops.lock().unwrap().iter().map(|t| (t.elements_in, t.elements_out)).collect();
    assert_eq!(counts, [(3, 2), (2, 2), (2, 2)], "the corrupt line never reached an op; the filter kept 2 of 3");

    let mut failing = pipeline;
    failing.data_plane.on_error = stoker_api::OnError::Fail;
    let err = epoch(failing, config(2)).await.map(|_| ()).unwrap_err();
    assert!(matches!(err, EngineError::Corrupt(_)), "{err}");
    assert!(err.to_string().contains("bad_json") && err.to_string().contains("a.jsonl"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_client_stops_production_at_the_memory_budget() {
    let dir = corpus(24, 2);
    // One 4-image batch is ~2.4 MB of float32: a 1-byte budget admits one batch at a time.
    let config = EngineConfig { memory_budget: 1, ..config(2) };
    let engine = Engine::open(resnet50_train(&uri(dir.path()), 4), config).await.unwrap();
    let (tx, rx) = sync_channel(16);
    let producer = tokio::task::spawn_blocking(move || engine.run_epoch(0, &tx));
    let held = tokio::task::spawn_blocking(move || {
        let first = rx.recv().unwrap();
        // While the first batch is held, only rows transformed with it (one chunk: this
        // split's 8 images, so one more batch) may still become ready, though the channel
        // has room; the chunk in flight beside it is not batched, and no later one starts.
        let mut early = vec![first];
        while let Ok(ready) = rx.recv_timeout(Duration::from_millis(1500)) {
            early.push(ready);
        }
        assert_eq!(early.len(), 2, "batches produced while the budget was exhausted");
        drop(early);
        let rest: Vec<_> = rx.iter().map(|r| r.batch.tensors["image"].shape[0]).collect();
        rest.len()
    })
    .await
    .unwrap();
    producer.await.unwrap().unwrap();
    assert_eq!(held, 4, "the other four batches follow once the first two are released");
}

/// The huge shuffle buffer: bufferSize four billion and a 256 KiB budget. The buffer
/// stops growing at half the budget instead of holding the whole corpus, every element still
/// arrives exactly once, and the capped shuffle repeats for the same seed.
#[tokio::test(flavor = "multi_thread")]
async fn a_huge_shuffle_buffer_is_capped_by_the_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    // 4 shards of 500 elements, each with 256 float64 values (2 KiB): 4 MiB of data in all,
    // sixteen times the budget.
    for shard in 0..4 {
        let lines: String = (0..500)
            .map(|i| format!("{{\"id\": {}, \"v\": [{}]}}\n", shard * 500 + i, vec!["0.5"; 256].join(",")))
            .collect();
        std::fs::write(dir.path().join(format!("{shard}.jsonl")), lines).unwrap();
    }
    let manifest = format!(
        "source: {{uri: '{}', format: jsonl}}\nbatchSize: 16\nshuffle: {{bufferSize: 4000000000, seed: 5}}\n",
        uri(dir.path())
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let budget = 256 << 10;
    // Each batch is dropped as soon as its ids are read: holding them would hold their share of
    // this small budget and stop production.
    let run = || async {
        let config = EngineConfig { memory_budget: budget, ..config(2) };
        let engine = Engine::open(WorkerPipeline::new("ns", "huge", &spec), config).await.unwrap();
        let (tx, rx) = sync_channel(2);
        let producer = tokio::task::spawn_blocking(move || engine.run_epoch(0, &tx).map(|()| engine));
        let ids = tokio::task::spawn_blocking(move || {
            rx.iter()
                .flat_map(|r| {
                    r.batch.tensors["id"]
                        .join()
                        .data
                        .chunks(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<i64>>()
        });
        let ids = tokio::time::timeout(Duration::from_secs(120), ids).await.expect("the epoch finishes").unwrap();
        (ids, producer.await.unwrap().unwrap())
    };
    let (order, engine) = run().await;

    let cap = engine.stats.shuffle_cap.lock().unwrap().expect("the buffer was capped");
    let peak = engine.stats.shuffle_peak_bytes.load(std::sync::atomic::Ordering::Relaxed) as usize;
    // One element costs its 2056 data bytes plus the row's bookkeeping (under 1.5 KiB).
    let element = 2056 + 1536;
    assert!(peak <= budget / 2 + element, "the buffer held {peak} bytes, over half the {budget}-byte budget");
    assert!(peak >= budget / 2, "the buffer filled its share: {peak} bytes");
    assert!((20..80).contains(&cap.elements) && cap.requested == 4_000_000_000, "{cap:?}");
    assert_eq!(cap.bytes, peak);

    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(sorted, (0..2000).collect::<Vec<i64>>(), "every element exactly once");
    assert_ne!(order, sorted, "still shuffled");
    let (again, engine) = run().await;
    assert_eq!(again, order, "the same seed and cap give the same order");
    assert_eq!(*engine.stats.shuffle_cap.lock().unwrap(), Some(cap));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_source_is_a_clear_error() {
    let err = Engine::open(resnet50_train("file:///nonexistent/stoker/", 8), config(1)).await.map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
}

/// The dispatcher is told a split is done only when all its elements are in batches: with a
/// shuffle buffer mixing splits, each split completes exactly once, in the batch holding its
/// last element or after the last batch.
#[tokio::test(flavor = "multi_thread")]
async fn splits_complete_once_their_last_element_is_batched() {
    let dir = tempfile::tempdir().unwrap();
    // Five shards of 3 lines; shard 3 is all filtered out, so it completes with no element.
    for shard in 0..5 {
        let lines: String =
            (0..3).map(|i| format!("{{\"x\": {}}}\n", if shard == 3 { -1 } else { shard * 10 + i })).collect();
        std::fs::write(dir.path().join(format!("{shard}.jsonl")), lines).unwrap();
    }
    let manifest = format!(
        "source: {{uri: '{}', format: jsonl}}\nbatchSize: 4\nshuffle: {{bufferSize: 5, seed: 3}}\n\
         transforms:\n- filter: {{field: x, op: ge, value: '0'}}\n",
        uri(dir.path())
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let engine = Engine::open(WorkerPipeline::new("ns", "t", &spec), config(2)).await.unwrap();
    let (ready, leftover) = run_dispatched(engine).await;
    let mut seen: Vec<i64> = Vec::new();
    let mut completed: Vec<u64> = Vec::new();
    for ready in ready {
        let x = ready.batch.tensors["x"].join();
        let xs = x.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()));
        seen.extend(xs);
        for &split in &ready.completes {
            // Shard n holds x in n*10..n*10+3: all of them must have been seen by now.
            let want: Vec<i64> = if split == 3 { vec![] } else { (0..3).map(|i| split as i64 * 10 + i).collect() };
            assert!(
                want.iter().all(|x| seen.contains(x)),
                "split {split} completed before its elements {want:?}; seen {seen:?}"
            );
        }
        completed.extend(&ready.completes);
    }
    completed.extend(leftover);
    completed.sort_unstable();
    assert_eq!(completed, [0, 1, 2, 3, 4], "every split completes exactly once");
    assert_eq!(seen.len(), 12);
}

/// A split whose last element fills a batch is completed by that batch, not reported by the
/// worker afterwards: a worker's own report could reach the dispatcher before the batch
/// reaches the client, and a worker killed in between would lose the batch for good.
#[tokio::test(flavor = "multi_thread")]
async fn a_split_ending_on_a_batch_boundary_is_carried_by_that_batch() {
    let dir = jsonl_files(3, 4, 10);
    let engine = Engine::open(WorkerPipeline::new("ns", "t", &jsonl_spec(dir.path(), 4)), config(2)).await.unwrap();
    let (ready, leftover) = run_dispatched(engine).await;
    let completes: Vec<Vec<u64>> = ready.into_iter().map(|r| r.completes).collect();
    assert_eq!(completes, [vec![0], vec![1], vec![2]], "each batch is one split and completes it");
    assert!(leftover.is_empty(), "nothing left for the worker to report: {leftover:?}");
}

/// Standalone (no dispatcher), the engine orders an epoch's splits itself: with `shuffle`,
/// each epoch takes the splits, and each split's elements, in an order of its own that the
/// seed repeats; without it, the listing's order. A one-element shuffle buffer leaves only
/// those two orders to see.
#[tokio::test(flavor = "multi_thread")]
async fn standalone_epochs_take_splits_and_elements_in_a_seeded_order_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    for shard in 0..4 {
        let lines: String = (0..10).map(|i| format!("{{\"x\": {}}}\n", shard * 100 + i)).collect();
        std::fs::write(dir.path().join(format!("{shard}.jsonl")), lines).unwrap();
    }
    let pipeline = |shuffle: &str| {
        let manifest = format!("source: {{uri: '{}', format: jsonl}}\nbatchSize: 5\n{shuffle}", uri(dir.path()));
        WorkerPipeline::new("ns", "t", &stoker_api::from_yaml(&manifest).unwrap())
    };
    let epochs = |pipeline: WorkerPipeline| async move {
        let engine = Engine::open(pipeline, config(2)).await.unwrap();
        tokio::task::spawn_blocking(move || {
            (0..2)
                .map(|epoch| {
                    let (tx, rx) = sync_channel(64);
                    engine.run_epoch(epoch, &tx).unwrap();
                    drop(tx);
                    collect(rx)
                        .iter()
                        .flat_map(|b| {
                            b.tensors["x"]
                                .data
                                .chunks(8)
                                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                                .collect::<Vec<_>>()
                        })
                        .collect::<Vec<i64>>()
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap()
    };
    let listing: Vec<i64> = (0..4).flat_map(|s| (0..10).map(move |i| s * 100 + i)).collect();
    let shuffled = epochs(pipeline("shuffle: {bufferSize: 1, seed: 9}\n")).await;
    for order in &shuffled {
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, listing, "every element once");
        assert_ne!(*order, listing);
        // Split by split: a split's elements stay together (the buffer holds one), in an order
        // of their own.
        let splits: Vec<i64> = order.chunks(10).map(|c| c[0] / 100).collect();
        assert!(order.chunks(10).all(|c| c.iter().all(|x| x / 100 == c[0] / 100)), "{order:?}");
        assert!(order.chunks(10).any(|c| c.windows(2).any(|w| w[0] > w[1])), "elements reordered: {order:?}");
        assert_eq!(splits.len(), 4);
    }
    assert_ne!(shuffled[0], shuffled[1], "each epoch its own order");
    assert_eq!(epochs(pipeline("shuffle: {bufferSize: 1, seed: 9}\n")).await, shuffled, "the seed repeats it");
    assert_eq!(epochs(pipeline("")).await, vec![listing.clone(), listing], "without shuffle, the listing's order");
}

/// A split produced again after its worker died leaves out what the first attempt delivered;
/// every row says where it came from, through the shuffle.
#[tokio::test(flavor = "multi_thread")]
async fn a_split_produced_again_leaves_out_the_positions_delivered_before() {
    let dir = tempfile::tempdir().unwrap();
    let lines: String = (0..10).map(|i| format!("{{\"x\": {i}}}\n")).collect();
    std::fs::write(dir.path().join("a.jsonl"), lines).unwrap();
    let manifest = format!(
        "source: {{uri: '{}', format: jsonl}}\nbatchSize: 4\nshuffle: {{bufferSize: 4, seed: 3}}\n",
        uri(dir.path())
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let engine = Engine::open(WorkerPipeline::new("ns", "again", &spec), config(1)).await.unwrap();
    let (tx, rx) = sync_channel(64);
    let engine = tokio::task::spawn_blocking(move || {
        let again = Assigned { skip: vec![1, 4, 9], ..Assigned::whole(engine.mix().split(0, 0).unwrap()) };
        engine.run_splits(0, [again], &tx).unwrap();
        engine
    })
    .await
    .unwrap();
    let batches = collect(rx);
    let mut produced = Vec::new();
    for b in &batches {
        let xs: Vec<i64> = b.tensors["x"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        let origins: Vec<i64> = b.rows.iter().map(|&r| stoker_api::row_origin(r)).map(|(_, p)| p as i64).collect();
        assert_eq!(xs, origins, "line i is position i of split 0, whatever the shuffle did");
        produced.extend(xs);
    }
    produced.sort_unstable();
    assert_eq!(produced, [0, 2, 3, 5, 6, 7, 8]);
    assert_eq!(engine.stats.redelivery_skipped.load(std::sync::atomic::Ordering::Relaxed), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_markers_change_no_batch() {
    // Sides up to 1000 px: some crops are decoded at a reduced scale, most from a cut.
    let dir = tempfile::tempdir().unwrap();
    let spec = CorpusSpec { images: 12, classes: 2, min_side: 400, max_side: 1000, ..Default::default() };
    generate(dir.path(), &spec).unwrap();
    let marked = tempfile::tempdir().unwrap();
    let report = stoker_worker::restart_markers::rewrite_tree(dir.path(), marked.path(), 32).unwrap();
    assert_eq!((report.rewritten, report.copied), (12, 0));
    let (plain, _) = epoch(resnet50_train(&uri(dir.path()), 4), config(2)).await.unwrap();
    let (cut, _) = epoch(resnet50_train(&uri(marked.path()), 4), config(2)).await.unwrap();
    assert_eq!(plain.len(), cut.len());
    for (a, b) in plain.iter().zip(&cut) {
        assert!(a.tensors["image"] == b.tensors["image"] && a.tensors["label"] == b.tensors["label"]);
    }
}

/// Runs `assigned` splits of epoch 0 and collects their batches.
async fn run_assigned(
    engine: Engine,
    assigned: impl FnOnce(&Engine) -> Vec<Assigned> + Send + 'static,
) -> (Vec<Batch>, Engine) {
    let (tx, rx) = sync_channel(256);
    let engine = tokio::task::spawn_blocking(move || {
        let splits = assigned(&engine);
        engine.run_splits(0, splits, &tx).unwrap();
        engine
    })
    .await
    .unwrap();
    (collect(rx), engine)
}

/// `echo` before a random crop: every image three times in an epoch, each copy a row of its
/// own (its copy number in the position) with a crop of its own, copy 0 the very crop made
/// without echo, and no two copies of an image next to each other.
#[tokio::test(flavor = "multi_thread")]
async fn echo_repeats_each_element_with_fresh_draws_after_it() {
    let dir = corpus(16, 2);
    let manifest = |echo: &str| {
        format!(
            "source: {{uri: '{}', format: imageFolder}}\nbatchSize: 5\ntransforms:\n- decodeImage: {{}}\n{echo}\
             - randomResizedCrop: {{size: [24, 24]}}\n",
            uri(dir.path())
        )
    };
    let open = |text: String| async move {
        let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&text).unwrap();
        Engine::open(WorkerPipeline::new("ns", "echo", &spec), config(2)).await.unwrap()
    };
    let rows = |batches: &[Batch]| -> Vec<(u64, u32, Vec<u8>)> {
        let mut out = Vec::new();
        for b in batches {
            let image = &b.tensors["image"];
            let per_row = image.data.len() / b.rows.len();
            for (i, &r) in b.rows.iter().enumerate() {
                let (split, position) = stoker_api::row_origin(r);
                out.push((split, position, image.data[i * per_row..(i + 1) * per_row].to_vec()));
            }
        }
        out
    };
    // Factor 1 as the plain run: an echo between them keeps the decode and the crop apart (not
    // fused into one decode of the crop's window, whose pixels differ slightly).
    let (plain, _) =
        run_assigned(open(manifest("- echo: {factor: 1}\n")).await, |e| e.assigned(0, &Default::default())).await;
    let (echoed, engine) =
        run_assigned(open(manifest("- echo: {factor: 3}\n")).await, |e| e.assigned(0, &Default::default())).await;
    assert!(echoed.iter().all(|b| b.echo), "batches say their rows carry copies");
    let (plain, echoed) = (rows(&plain), rows(&echoed));
    assert_eq!((plain.len(), echoed.len()), (16, 48));
    assert_eq!(engine.stats.echoed.load(std::sync::atomic::Ordering::Relaxed), 32);
    let counts: Vec<_> = engine.stats.ops.lock().unwrap().iter().map(|t| (t.elements_in, t.elements_out)).collect();
    assert_eq!(counts, [(16, 16), (16, 48), (48, 48)], "the decode once per element, the crop once per copy");
    let mut seen = std::collections::BTreeMap::new();
    for (split, position, pixels) in &echoed {
        let (copy, element) = stoker_api::echo_copy(*position);
        assert!(copy < 3, "copy {copy}");
        assert!(seen.insert((*split, element, copy), pixels.clone()).is_none(), "each copy once");
    }
    for (split, position, pixels) in &plain {
        let copies: Vec<&Vec<u8>> = (0..3).map(|c| &seen[&(*split, *position, c)]).collect();
        assert_eq!(copies[0], pixels, "copy 0 draws what the element draws without echo");
        assert!(copies[0] != copies[1] && copies[1] != copies[2] && copies[0] != copies[2], "fresh draws per copy");
    }
    for pair in echoed.windows(2) {
        let element = |(s, p, _): &(u64, u32, Vec<u8>)| (*s, stoker_api::echo_copy(*p).1);
        assert_ne!(element(&pair[0]), element(&pair[1]), "copies of one element are never adjacent");
    }
}

/// A split of an echoing pipeline produced again leaves out the copies delivered before: an
/// element whose every copy was delivered is not even read, one with some copies delivered
/// gives the others.
#[tokio::test(flavor = "multi_thread")]
async fn echo_produced_again_leaves_out_the_copies_delivered_before() {
    let dir = tempfile::tempdir().unwrap();
    let lines: String = (0..6).map(|i| format!("{{\"x\": {i}}}\n")).collect();
    std::fs::write(dir.path().join("a.jsonl"), lines).unwrap();
    let manifest = format!(
        "source: {{uri: '{}', format: jsonl}}\nbatchSize: 4\ntransforms: [{{echo: {{factor: 3}}}}]\n\
         shuffle: {{bufferSize: 4, seed: 3}}\n",
        uri(dir.path())
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let engine = Engine::open(WorkerPipeline::new("ns", "again", &spec), config(1)).await.unwrap();
    let at = |element, copy| stoker_api::echo_position(element, copy) as u32;
    let mut delivered = vec![at(1, 0), at(1, 1), at(1, 2), at(4, 1), at(5, 0)];
    delivered.sort_unstable();
    let (batches, engine) = run_assigned(engine, move |e| {
        vec![Assigned { skip: delivered, ..Assigned::whole(e.mix().split(0, 0).unwrap()) }]
    })
    .await;
    let mut produced = Vec::new();
    for b in &batches {
        let xs = b.tensors["x"].data.chunks(8).map(|c| u32::from_le_bytes(c[..4].try_into().unwrap()));
        for (x, &r) in xs.zip(&b.rows) {
            let (copy, element) = stoker_api::echo_copy(stoker_api::row_origin(r).1);
            assert_eq!(x, element, "line i is element i of split 0 in every copy");
            produced.push((element, copy));
        }
    }
    produced.sort_unstable();
    let mut want: Vec<(u32, u32)> = (0..6).flat_map(|e| (0..3).map(move |c| (e, c))).collect();
    want.retain(|&(e, c)| e != 1 && (e, c) != (4, 1) && (e, c) != (5, 0));
    assert_eq!(produced, want);
    assert_eq!(engine.stats.redelivery_skipped.load(std::sync::atomic::Ordering::Relaxed), 5);
}

/// An engine over `files` JSONL files of `lines` lines each (`x` counting from 0 across
/// them), a split a file, batches of 4, one thread.
async fn share_group_engine(files: i64, lines: i64) -> (tempfile::TempDir, std::sync::Arc<Engine>) {
    let dir = jsonl_files(files, lines, lines);
    let spec = jsonl_spec(dir.path(), 4);
    let config = EngineConfig { files_per_split: 1, ..config(1) };
    let engine = Engine::open(WorkerPipeline::new("ns", "shared", &spec), config).await.unwrap();
    (dir, std::sync::Arc::new(engine))
}

/// The splits `ids` of epoch 0, each a production (key `(1, id)`) for two jobs.
fn productions(engine: &Engine, ids: std::ops::Range<u64>) -> Vec<Assigned> {
    let splits = engine.mix().epoch(0);
    let production = |id| Some(stoker_worker::engine::Shared { key: (1, id), takers: 2 });
    let chosen: Vec<_> = splits
        .into_iter()
        .filter(|s| ids.contains(&s.id))
        .map(|s| Assigned { shared: production(s.id), ..Assigned::whole(s) })
        .collect();
    assert_eq!(chosen.len(), ids.count(), "a split a file");
    chosen
}

/// Two jobs of a share group on one worker, four productions for both: the first producer's
/// consumer stops reading once it has a batch, the second's reads everything. The held-up
/// producer made the first; the fast one makes the other three itself at once rather than
/// waiting, split after split, for a copy the held-up one had claimed and could not begin.
#[tokio::test(flavor = "multi_thread")]
async fn a_producer_held_by_its_consumer_claims_no_production_it_cannot_begin() {
    use std::sync::atomic::Ordering::Relaxed;
    let (_dir, engine) = share_group_engine(4, 40).await;
    let assigned = |engine: &Engine| productions(engine, 0..4);

    // The held-up consumer takes nothing: its producer stops at a full channel, in the first
    // split's batches.
    let (held_tx, held_rx) = sync_channel(1);
    let held = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.run_splits(0, assigned(&engine), &held_tx).map(drop))
    };
    // Held: it made the first production and sent a batch of it (and counted a second).
    wait_until("the held-up producer makes a production", || {
        shared_counts(&engine).0 == 1 && engine.stats.batches.load(Relaxed) >= 2
    });

    let (tx, rx) = sync_channel(1024);
    let fast = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.run_splits(0, assigned(&engine), &tx).map(drop))
    };
    fast.await.unwrap().unwrap();
    assert_eq!(sorted_xs(rx), (0..160).collect::<Vec<i64>>(), "every line once");
    // Made: one by the held-up producer, three by the other; the first taken whole; no copy
    // waited for and then made again.
    assert_eq!(shared_counts(&engine), (4, 40, 0), "made, rows taken, made again");
    drop(held_rx);
    held.join().unwrap().unwrap();
}

/// Two jobs of a share group on one worker, two productions of splits of 200 lines (four
/// chunks each) for both. The first producer makes the first and its consumer reads it all;
/// the second takes that copy for a consumer that stops reading after a batch, so it has the
/// copy's rows still to send when it comes to the second production. It leaves that one to
/// the first producer, which makes it at once: claimed, it would have recorded a chunk and
/// stopped, and the first producer would have waited for its copy and made the rest again.
#[tokio::test(flavor = "multi_thread")]
async fn a_producer_with_a_copy_still_to_send_claims_no_production() {
    use std::sync::atomic::Ordering::Relaxed;
    let (_dir, engine) = share_group_engine(2, 200).await;
    // On a thread of its own: the engine blocks on its runtime.
    let made_alone = |engine: &std::sync::Arc<Engine>, ids: std::ops::Range<u64>| {
        let engine = engine.clone();
        std::thread::spawn(move || {
            let (tx, rx) = sync_channel(1024);
            engine.run_splits(0, productions(&engine, ids), &tx).unwrap();
            drop(tx);
            sorted_xs(rx)
        })
        .join()
        .unwrap()
    };
    assert_eq!(made_alone(&engine, 0..1), (0..200).collect::<Vec<i64>>(), "the first production");
    let batches = engine.stats.batches.load(Relaxed);

    // The held-up consumer takes one batch of the copy and stops.
    let (held_tx, held_rx) = sync_channel(1);
    let held = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.run_splits(0, productions(&engine, 0..2), &held_tx).map(drop))
    };
    wait_until("the held-up producer takes the copy and sends from it", || {
        shared_counts(&engine).1 == 200 && engine.stats.batches.load(Relaxed) >= batches + 2
    });

    assert_eq!(made_alone(&engine, 1..2), (200..400).collect::<Vec<i64>>(), "the second production");
    // Made: both by the first producer; only the first copy taken; none made again.
    assert_eq!(shared_counts(&engine), (2, 200, 0), "made, rows taken, made again");
    drop(held_rx);
    held.join().unwrap().unwrap();
}

/// Two jobs of a share group on one worker, one production of a split for both: the first
/// producer makes it for a consumer that stops reading after a batch, the second takes the
/// rows made so far once the copy stops growing and makes only the rest. It gets every line
/// once, without waiting out its patience for the held-up maker.
#[tokio::test(flavor = "multi_thread")]
async fn a_taker_takes_what_a_held_up_maker_made_and_makes_the_rest() {
    use std::sync::atomic::Ordering::Relaxed;
    use stoker_worker::engine::Shared;
    let dir = tempfile::tempdir().unwrap();
    let lines: String = (0..1000).map(|i| format!("{{\"x\": {i}}}\n")).collect();
    std::fs::write(dir.path().join("a.jsonl"), lines).unwrap();
    let spec = jsonl_spec(dir.path(), 4);
    let engine =
        std::sync::Arc::new(Engine::open(WorkerPipeline::new("ns", "shared", &spec), config(1)).await.unwrap());
    let production = Shared { key: (1, 7), takers: 2 };
    let assigned = move |engine: &Engine| Assigned {
        shared: Some(production),
        ..Assigned::whole(engine.mix().split(0, 0).unwrap())
    };

    // The maker's consumer takes nothing: its producer stops at a full channel.
    let (maker_tx, maker_rx) = sync_channel(1);
    let maker = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.run_splits(0, [assigned(&engine)], &maker_tx).map(drop))
    };
    wait_until("the first producer claims the production", || shared_counts(&engine).0 == 1);

    let (tx, rx) = sync_channel(1024);
    let started = std::time::Instant::now();
    let taker = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.run_splits(0, [assigned(&engine)], &tx).map(drop))
    };
    taker.await.unwrap().unwrap();
    let took = started.elapsed();
    assert_eq!(sorted_xs(rx), (0..1000).collect::<Vec<i64>>(), "every line once");
    let (_, taken, made_again) = shared_counts(&engine);
    assert!(taken > 0 && taken < 1000, "part taken: {taken} rows");
    assert_eq!(made_again, 1, "the rest made");
    assert!(
        took < stoker_worker::engine::TAKE_PATIENCE - Duration::from_secs(1),
        "the taker waited {took:?}: its patience, not the copy's stillness"
    );
    assert!(engine.stats.redelivery_skipped.load(Relaxed) >= taken, "the taken positions were not made again");
    drop(maker_rx);
    maker.join().unwrap().unwrap();
}
