#![allow(dead_code)]
//! A fake gRPC dataplane agent (what Calico/VPP's agent is to upstream's plugin), built from
//! the same `cnibackend.proto` as the plugin (build.rs generates its server code for the
//! tests only): it listens on a Unix socket in a temp dir, on a thread of its own with its
//! own runtime, records every Add and Del, and answers as told (`Reply`). Stopped on drop.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cni::TempDir;

/// The messages and the server generated from the plugin's proto.
#[allow(clippy::all, clippy::pedantic)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/grpc-server/cni.rs"));
}

use proto::cni_dataplane_server::{CniDataplane, CniDataplaneServer};

/// How the agent answers.
#[derive(Clone, Debug)]
pub enum Reply {
    /// Successful, with this host interface and container MAC (Del ignores both).
    Success { host_interface: String, mac: String },
    /// Not successful, with this error message.
    Fail(String),
    /// Never answers (until the agent is dropped).
    Stall,
}

impl Reply {
    pub fn success(host_interface: &str, mac: &str) -> Reply {
        Reply::Success {
            host_interface: host_interface.into(),
            mac: mac.into(),
        }
    }
}

/// One request the agent received.
#[derive(Clone, Debug)]
pub enum Received {
    Add(Box<proto::AddRequest>),
    Del(proto::DelRequest),
}

/// Run (on the agent's thread) when an Add arrives, before it is answered.
pub type Hook = Box<dyn Fn() + Send>;

struct State {
    add: Reply,
    del: Reply,
    received: Vec<Received>,
    on_add: Option<Hook>,
}

struct Agent(Arc<Mutex<State>>);

impl Agent {
    /// Records `r` and gives the reply to make.
    fn record(&self, r: Received, add: bool) -> Reply {
        let mut s = self.0.lock().unwrap();
        s.received.push(r);
        if add {
            s.add.clone()
        } else {
            s.del.clone()
        }
    }
}

#[tonic::async_trait]
impl CniDataplane for Agent {
    async fn add(
        &self,
        request: tonic::Request<proto::AddRequest>,
    ) -> Result<tonic::Response<proto::AddReply>, tonic::Status> {
        let reply = self.record(Received::Add(Box::new(request.into_inner())), true);
        if let Some(hook) = &self.0.lock().unwrap().on_add {
            hook();
        }
        let out = match reply {
            Reply::Success {
                host_interface,
                mac,
            } => proto::AddReply {
                successful: true,
                error_message: String::new(),
                host_interface_name: host_interface,
                container_mac: mac,
            },
            Reply::Fail(msg) => proto::AddReply {
                successful: false,
                error_message: msg,
                ..Default::default()
            },
            Reply::Stall => std::future::pending().await,
        };
        Ok(tonic::Response::new(out))
    }

    async fn del(
        &self,
        request: tonic::Request<proto::DelRequest>,
    ) -> Result<tonic::Response<proto::DelReply>, tonic::Status> {
        let reply = self.record(Received::Del(request.into_inner()), false);
        let out = match reply {
            Reply::Success { .. } => proto::DelReply {
                successful: true,
                error_message: String::new(),
            },
            Reply::Fail(msg) => proto::DelReply {
                successful: false,
                error_message: msg,
            },
            Reply::Stall => std::future::pending().await,
        };
        Ok(tonic::Response::new(out))
    }
}

/// A running fake agent.
pub struct GrpcDataplane {
    dir: TempDir,
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GrpcDataplane {
    /// Starts an agent answering Add with `add` and Del with success.
    pub fn start(add: Reply) -> GrpcDataplane {
        let dir = TempDir::new("grpc-dp");
        let socket = dir.path().join("cni.sock");
        let state = Arc::new(Mutex::new(State {
            add,
            del: Reply::success("", ""),
            received: Vec::new(),
            on_add: None,
        }));
        // Bound here, so the socket exists once `start` returns.
        let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind the socket");
        listener.set_nonblocking(true).expect("non-blocking socket");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let agent = Agent(state.clone());
        let thread = std::thread::Builder::new()
            .name("fake-grpc-dataplane".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::UnixListener::from_std(listener).expect("tokio listener");
                    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                    let server = tonic::transport::Server::builder()
                        .add_service(CniDataplaneServer::new(agent))
                        .serve_with_incoming(incoming);
                    // Stopping drops the server and, with the runtime, any stalled request.
                    tokio::select! {
                        r = server => r.expect("the fake dataplane's server failed"),
                        _ = stopped => {}
                    }
                });
            })
            .expect("spawn the fake dataplane");
        GrpcDataplane {
            dir,
            socket,
            state,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The `socket` option naming it (`unix:///...`).
    pub fn address(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    pub fn set_add(&self, r: Reply) {
        self.state.lock().unwrap().add = r;
    }

    /// Runs `hook` at every Add, before answering it (it may block: the agent serves one
    /// call at a time anyway).
    pub fn on_add(&self, hook: impl Fn() + Send + 'static) {
        self.state.lock().unwrap().on_add = Some(Box::new(hook));
    }

    pub fn set_del(&self, r: Reply) {
        self.state.lock().unwrap().del = r;
    }

    /// Every request so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.state.lock().unwrap().received.clone()
    }

    pub fn adds(&self) -> Vec<proto::AddRequest> {
        self.received()
            .into_iter()
            .filter_map(|r| match r {
                Received::Add(a) => Some(*a),
                Received::Del(_) => None,
            })
            .collect()
    }

    pub fn dels(&self) -> Vec<proto::DelRequest> {
        self.received()
            .into_iter()
            .filter_map(|r| match r {
                Received::Del(d) => Some(d),
                Received::Add(_) => None,
            })
            .collect()
    }
}

impl Drop for GrpcDataplane {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            // The server stops at once; a thread that does not is not waited for forever.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(t.join());
            });
            let _ = rx.recv_timeout(Duration::from_secs(10));
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}
