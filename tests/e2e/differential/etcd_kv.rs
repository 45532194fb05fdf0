//! An etcd client for the harness, in this process: a thread that has joined the world's
//! netns (where etcd listens on 127.0.0.1) runs the requests on its own runtime. Seeding,
//! wiping and dumping `/calico` take a millisecond each this way (an `etcdctl` per request
//! took ten).

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::mpsc;

use etcd_client::{Client, DeleteOptions, GetOptions, Txn, TxnOp};

enum Job {
    /// Every (key, value) under a prefix, in key order.
    Dump(String, mpsc::Sender<Result<Vec<(String, String)>, String>>),
    /// Deletes everything under a prefix, then puts the pairs (one transaction each).
    Replace(
        String,
        Vec<(String, String)>,
        mpsc::Sender<Result<(), String>>,
    ),
}

pub struct EtcdKv {
    tx: Option<tokio::sync::mpsc::UnboundedSender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EtcdKv {
    pub fn connect(netns_path: &str, endpoint: &str) -> EtcdKv {
        let ns = File::open(netns_path).expect("open the world's netns");
        let endpoint = endpoint.to_string();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("differential-etcd".into())
            .spawn(move || {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("enter the world's netns");
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                rt.block_on(async move {
                    let mut client = Client::connect([endpoint.as_str()], None)
                        .await
                        .expect("connect to the world's etcd");
                    while let Some(job) = rx.recv().await {
                        match job {
                            Job::Dump(prefix, reply) => {
                                let r = client
                                    .get(prefix, Some(GetOptions::new().with_prefix()))
                                    .await
                                    .map(|resp| {
                                        resp.kvs()
                                            .iter()
                                            .map(|kv| {
                                                (
                                                    String::from_utf8_lossy(kv.key()).into_owned(),
                                                    String::from_utf8_lossy(kv.value())
                                                        .into_owned(),
                                                )
                                            })
                                            .collect()
                                    })
                                    .map_err(|e| e.to_string());
                                let _ = reply.send(r);
                            }
                            Job::Replace(prefix, pairs, reply) => {
                                let mut r = client
                                    .delete(prefix, Some(DeleteOptions::new().with_prefix()))
                                    .await
                                    .map(|_| ())
                                    .map_err(|e| e.to_string());
                                for chunk in pairs.chunks(100) {
                                    if r.is_err() {
                                        break;
                                    }
                                    let ops: Vec<TxnOp> = chunk
                                        .iter()
                                        .map(|(k, v)| TxnOp::put(k.as_str(), v.as_str(), None))
                                        .collect();
                                    r = client
                                        .txn(Txn::new().and_then(ops))
                                        .await
                                        .map(|_| ())
                                        .map_err(|e| e.to_string());
                                }
                                let _ = reply.send(r);
                            }
                        }
                    }
                });
            })
            .expect("spawn the etcd client thread");
        EtcdKv {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    fn send(&self, job: Job) {
        self.tx
            .as_ref()
            .expect("the etcd client runs")
            .send(job)
            .expect("the etcd client thread is alive");
    }

    pub fn dump(&self, prefix: &str) -> Vec<(String, String)> {
        let (reply, rx) = mpsc::channel();
        self.send(Job::Dump(prefix.into(), reply));
        rx.recv()
            .expect("the etcd client answers")
            .unwrap_or_else(|e| panic!("read {prefix} from etcd: {e}"))
    }

    /// Everything under `prefix` replaced by `pairs`.
    pub fn replace(&self, prefix: &str, pairs: Vec<(String, String)>) {
        let (reply, rx) = mpsc::channel();
        self.send(Job::Replace(prefix.into(), pairs, reply));
        rx.recv()
            .expect("the etcd client answers")
            .unwrap_or_else(|e| panic!("replace {prefix} in etcd: {e}"));
    }
}

impl Drop for EtcdKv {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
