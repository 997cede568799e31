//! TLS end to end with real processes: `stoker local`'s dispatcher and its `stoker-worker`
//! processes serving TLS with certificates from a throwaway CA, and clients that verify them.
//! A client with the right CA streams batches (from workers it dials by IP and verifies by
//! their Service's name); one with another CA, or speaking plaintext, fails with an error that
//! says why, well before its connect timeout.

use std::time::{Duration, Instant};

use stoker_client::{Client, ClientOptions, Error};
use stoker_local::workers::{LocalWorkerConfig, worker_binary};
use stoker_local::{Local, LocalOptions};

fn corpus(dir: &std::path::Path) {
    for shard in 0..4 {
        let lines: String = (0..100).map(|i| format!("{{\"id\": {}}}\n", shard * 1000 + i)).collect();
        std::fs::write(dir.join(format!("{shard:02}.jsonl")), lines).unwrap();
    }
}

async fn start(data: &std::path::Path, logs: &std::path::Path, tls: &std::path::Path) -> Local {
    assert!(worker_binary().is_file(), "run `cargo build --workspace --bins` first");
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\nautoscaling: {{mode: Fixed, replicas: 2}}\n",
        data.display()
    );
    Local::start(LocalOptions {
        namespace: "test".into(),
        name: "secret-lines".into(),
        spec: stoker_api::from_yaml(&manifest).unwrap(),
        listen: "127.0.0.1:0".parse().unwrap(),
        workers: LocalWorkerConfig {
            binary: worker_binary(),
            dispatcher_url: String::new(),
            threads: 1,
            memory_budget: 32 << 20,
            max_batch_rate: None,
            log_dir: Some(logs.to_path_buf()),
            cache_dir: None,
            tls: None,
        },
        window: None,
        budget: None,
        tls_dir: Some(tls.to_path_buf()),
    })
    .await
    .unwrap()
}

fn options(ca: Option<&std::path::Path>) -> ClientOptions {
    let mut options = ClientOptions::new("test", "secret-lines");
    options.tls_ca = ca.map(std::path::Path::to_path_buf);
    options.connect_timeout = Duration::from_secs(20);
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_verify_the_dispatcher_and_workers_and_say_why_when_they_cannot() {
    let (data, logs, tls) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    corpus(data.path());
    let local = start(data.path(), logs.path(), tls.path()).await;
    assert!(local.url.starts_with("https://"), "{}", local.url);
    let ca = local.ca_file.clone().expect("TLS on: a CA for clients");
    let key_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(tls.path().join("workers.key")).unwrap().permissions(),
    );
    assert_eq!(key_mode & 0o077, 0, "keys are private to their owner");

    // The right CA: a whole epoch arrives, from TLS workers verified by their Service's name.
    let mut client = Client::from_dispatcher(&local.url, options(Some(&ca))).await.unwrap();
    let mut ids = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.len() < 400 {
        assert!(Instant::now() < deadline, "only {} of 400 rows within 60 s", ids.len());
        let batch =
            tokio::time::timeout(Duration::from_secs(30), client.next()).await.expect("a batch").unwrap().unwrap();
        if let Some(id) = batch.tensors.get("id") {
            ids.extend(id.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())));
        }
    }
    assert_eq!(ids.len(), 400, "every row of the epoch, once");
    drop(client);

    // The workers really serve TLS, with a certificate for their Service's name, not their IP:
    // dialled as a fixed list (verifying the IP) the name does not match; in plaintext, no answer.
    let worker = local.dispatcher.with_state(|s| s.listing(&local.key)).workers[0].0.clone();
    let e = Client::connect(vec![format!("https://{worker}")], options(Some(&ca))).await.err().expect("refused");
    assert!(e.to_string().contains("not for the name this client expects"), "{e}");
    // Plaintext gets no batch. The TLS server's alert usually reads as an oversized HTTP/2 frame,
    // which the client reports as a likely TLS server; when the server closes the connection
    // before the client reads the alert, it is a plain transport error (found in CI), so the
    // hint is checked only when given.
    let e = Client::connect(vec![format!("http://{worker}")], options(None)).await.err().expect("refused");
    assert!(!matches!(e, Error::Tls { .. }) || e.to_string().contains("probably serves TLS"), "{e}");

    // Another CA: refused at once with what is wrong, not retried until the timeout.
    let (other, _) = stoker_operator::tls::Ca::generate("another CA", Duration::from_secs(3600)).unwrap();
    let wrong = tls.path().join("wrong-ca.crt");
    std::fs::write(&wrong, other.cert_pem()).unwrap();
    let started = Instant::now();
    let e = Client::from_dispatcher(&local.url, options(Some(&wrong))).await.err().expect("refused");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    assert!(e.to_string().contains("not signed by a CA this client trusts"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10), "failed fast, not after the connect timeout");

    // A dispatcher dialled by an address its certificate does not name (a cluster IP, a
    // port-forward) is verified against `tls_server_name` instead: the certificate names
    // localhost, so that name is accepted and another refused.
    let mut named = options(Some(&ca));
    named.tls_server_name = Some("localhost".into());
    Client::from_dispatcher(&local.url, named.clone()).await.expect("verified as localhost");
    named.tls_server_name = Some("elsewhere.example".into());
    let e = Client::from_dispatcher(&local.url, named).await.err().expect("refused");
    assert!(e.to_string().contains("not for the name this client expects"), "{e}");

    // https:// without any CA: refused before dialling.
    let e = Client::from_dispatcher(&local.url, options(None)).await.err().expect("refused");
    assert!(e.to_string().contains("no CA"), "{e}");

    // Plaintext to the TLS dispatcher: refused (with the TLS hint when the alert is read, as
    // above).
    let plain = local.url.replacen("https://", "http://", 1);
    let mut quick = options(None);
    quick.connect_timeout = Duration::from_secs(3);
    let e = Client::from_dispatcher(&plain, quick).await.err().expect("refused");
    assert!(!matches!(e, Error::Tls { .. }) || e.to_string().contains("TLS"), "{e}");
    local.shutdown().await;
}
