//! The order a training loop sees, with real processes: a class-sorted image folder (as a
//! store lists ImageNet) streamed through a dispatcher, a `stoker-worker` and the Rust client.
//! With `shuffle` the first batches of every epoch already hold most classes, epochs differ,
//! and the same seed with the same worker count repeats the order; without it, the listing's
//! order reaches the trainer (a few classes at a time), as an evaluation pass wants.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use stoker_api::{Batch, WorkerPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const CLASSES: i64 = 20;
const PER_CLASS: i64 = 100;
const BATCH: usize = 64;

/// 20 class folders of 100 files each. The files are never decoded (the pipeline keeps only
/// the label), so a few bytes stand in for each image.
fn class_sorted_folder(dir: &std::path::Path) {
    for class in 0..CLASSES {
        let folder = dir.join(format!("class{class:02}"));
        std::fs::create_dir_all(&folder).unwrap();
        for i in 0..PER_CLASS {
            std::fs::write(folder.join(format!("{i:04}.jpg")), [0u8; 4]).unwrap();
        }
    }
}

fn labels(batch: &Batch) -> Vec<i64> {
    batch.tensors["label"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The labels of each batch of epochs 0 and 1, in arrival order, read through a dispatcher
/// from one worker.
async fn two_epochs(shuffle: &str) -> BTreeMap<u64, Vec<Vec<i64>>> {
    let data = tempfile::tempdir().unwrap();
    class_sorted_folder(data.path());
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: imageFolder}}\nbatchSize: {BATCH}\n\
         transforms: [{{selectFields: {{fields: [label]}}}}]\n{shuffle}",
        data.path().display()
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let s = support::dispatched(WorkerPipeline::new("ns", "classes", &spec), Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 1).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "classes")).await.unwrap();
    let mut epochs: BTreeMap<u64, Vec<Vec<i64>>> = BTreeMap::new();
    let all = (CLASSES * PER_CLASS) as usize;
    let complete = |epochs: &BTreeMap<u64, Vec<Vec<i64>>>, e| epochs.get(&e).is_some_and(|b| b.concat().len() == all);
    tokio::time::timeout(Duration::from_secs(60), async {
        while !(complete(&epochs, 0) && complete(&epochs, 1)) {
            let batch = client.next().await.expect("the client never ends under a dispatcher").expect("no error");
            epochs.entry(batch.epoch).or_default().push(labels(&batch));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("two epochs did not arrive within 60 s"));
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    assert_eq!((jobs[0].requeued, jobs[0].repeats), (0, 0), "no split handed out twice: {:?}", jobs[0]);
    s.workers.scale(&s.key, 0).await.unwrap();
    epochs.retain(|e, _| *e < 2);
    epochs
}

/// Distinct classes in the first `n` batches of an epoch.
fn classes_in_first(batches: &[Vec<i64>], n: usize) -> usize {
    batches.iter().take(n).flatten().collect::<BTreeSet<_>>().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_sorted_folder_reaches_the_loop_mixed_and_each_epoch_differently() {
    let shuffled = two_epochs("shuffle: {bufferSize: 256, seed: 7}\n").await;
    let in_order = two_epochs("").await;
    for (name, epochs) in [("shuffled", &shuffled), ("listing order", &in_order)] {
        for (epoch, batches) in epochs {
            let mut per_class: BTreeMap<i64, i64> = BTreeMap::new();
            for label in batches.concat() {
                *per_class.entry(label).or_default() += 1;
            }
            assert_eq!(
                per_class,
                (0..CLASSES).map(|c| (c, PER_CLASS)).collect(),
                "{name}, epoch {epoch}: every image once"
            );
        }
        eprintln!(
            "{name}: classes in the first 1 / 3 batches of {BATCH}: epoch 0 {} / {}, epoch 1 {} / {}",
            classes_in_first(&epochs[&0], 1),
            classes_in_first(&epochs[&0], 3),
            classes_in_first(&epochs[&1], 1),
            classes_in_first(&epochs[&1], 3)
        );
    }
    for epoch in [0, 1] {
        // Drawing 64 of 2000 images at random shows about 19 of the 20 classes.
        assert!(classes_in_first(&shuffled[&epoch], 1) >= 15, "epoch {epoch}: {:?}", shuffled[&epoch][0]);
        assert!(classes_in_first(&shuffled[&epoch], 3) >= 18, "epoch {epoch}");
        // The listing's order: the first three batches (192 images) hold two or three classes.
        assert!(classes_in_first(&in_order[&epoch], 3) <= 3, "epoch {epoch}");
    }
    assert_ne!(shuffled[&0], shuffled[&1], "each epoch has its own order");
    assert_eq!(in_order[&0], in_order[&1], "without shuffle every epoch is the listing's order");
    let again = two_epochs("shuffle: {bufferSize: 256, seed: 7}\n").await;
    assert_eq!(again, shuffled, "the same seed and worker count repeat the order");
}
