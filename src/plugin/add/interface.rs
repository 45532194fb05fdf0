//! The pod's interface through ADD, as a state machine: built once IPAM starts, for the
//! request the pod makes (`build`: names, MTU, queues, its `hwAddr` MAC, the expected
//! families), then given its addresses and routes (`finish`).
//!
//! Every transition is here, and each either moves the interface on or leaves nothing of its
//! own (a failed build or finish removes what it made). What stands at a failure is removed
//! by ADD's one rollback (`Made::rollback`), which asks `take_for_removal`.
//!
//! Generic over the `Dataplane`, so that every sequence is unit-tested with a fake (`tests`).

use crate::dataplane::{
    AddressRequest, Dataplane, DataplaneError, NetworkingResult, PodFacts, PodInterface,
    VethRequest,
};

/// Where the pod's interface stands.
pub enum Stage<P: Dataplane> {
    /// Not built: the call's dataplane, which builds it when IPAM starts.
    Unbuilt(P),
    /// Built for the pod's request: IPAM's partner, then finished.
    Up(P::Interface),
    /// A step failed, having removed what it made; or a step is under way with it.
    Gone,
}

impl<P: Dataplane> Stage<P> {
    /// The interface for the pod's request `req`: `Unbuilt` → `Up`. A failure → `Gone`
    /// (what it made is removed).
    pub async fn build(self, req: VethRequest) -> (Stage<P>, Result<(), DataplaneError>) {
        let built = match self {
            Stage::Unbuilt(dataplane) => dataplane.build(req).await,
            Stage::Up(_) | Stage::Gone => Err(DataplaneError::Internal(
                "the pod interface was built twice",
            )),
        };
        match built {
            Ok(interface) => (Stage::Up(interface), Ok(())),
            Err(e) => (Stage::Gone, Err(e)),
        }
    }

    /// Gives an `Up` interface its addresses and routes; it stays `Up`. A failure → `Gone`
    /// (`finish` removes what this call made).
    pub async fn finish(
        self,
        addrs: &AddressRequest,
        pod: &PodFacts<'_>,
    ) -> (Stage<P>, Result<NetworkingResult, DataplaneError>) {
        let Stage::Up(mut interface) = self else {
            let e = DataplaneError::Internal("the pod interface was finished before it was built");
            return (Stage::Gone, Err(e));
        };
        match interface.finish(addrs, pod).await {
            Ok(net) => (Stage::Up(interface), Ok(net)),
            Err(e) => (Stage::Gone, Err(e)),
        }
    }

    /// The interface's container-end MAC, when it is known before `finish` (`Up` only).
    pub fn known_mac(&self, addrs: &AddressRequest) -> Option<String> {
        match self {
            Stage::Up(interface) => interface.known_mac(addrs),
            _ => None,
        }
    }

    /// Whether ADD's result gives the addresses as host networks (`Up` only; the Linux
    /// dataplane's answer otherwise, which only matters once the interface is up).
    pub fn result_has_host_addresses(&self) -> bool {
        match self {
            Stage::Up(interface) => interface.result_has_host_addresses(),
            _ => true,
        }
    }

    /// What the rollback must remove: the interface this call built.
    pub fn take_for_removal(self) -> Option<P::Interface> {
        match self {
            Stage::Up(interface) => Some(interface),
            Stage::Unbuilt(_) | Stage::Gone => None,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeMap;
    use std::rc::Rc;

    use super::*;
    use crate::dataplane::netlink_errno;
    use crate::datastore::model::WorkloadEndpoint;

    /// A dataplane that logs what it is asked and fails where it is told to.
    #[derive(Clone, Default)]
    pub struct FakeDataplane {
        pub fail_build: bool,
        pub fail_finish: bool,
        /// The MAC the interface knows before `finish`.
        pub known_mac: Option<&'static str>,
        pub log: Rc<RefCell<Vec<&'static str>>>,
        /// How many interfaces stand in the fake kernel (each step that fails removes
        /// what it made, as the real ones do).
        pub standing: Rc<Cell<i32>>,
    }

    /// The MAC the fake's `finish` reports (upper-case, as the kernel's text may be).
    pub const FINISHED_MAC: &str = "0a:58:0a:50:00:01";

    pub struct FakeInterface(pub FakeDataplane);

    impl Dataplane for FakeDataplane {
        type Interface = FakeInterface;
        async fn build(self, _req: VethRequest) -> Result<FakeInterface, DataplaneError> {
            self.log.borrow_mut().push("build");
            match self.fail_build {
                true => Err(DataplaneError::CreateVeth(netlink_errno(libc::EEXIST))),
                false => {
                    self.standing.set(self.standing.get() + 1);
                    Ok(FakeInterface(self))
                }
            }
        }
    }

    impl PodInterface for FakeInterface {
        async fn finish(
            &mut self,
            _addrs: &AddressRequest,
            _pod: &PodFacts<'_>,
        ) -> Result<NetworkingResult, DataplaneError> {
            self.0.log.borrow_mut().push("finish");
            match self.0.fail_finish {
                true => {
                    self.0.standing.set(self.0.standing.get() - 1);
                    Err(DataplaneError::GatewayRoute(netlink_errno(
                        libc::ENETUNREACH,
                    )))
                }
                false => Ok(NetworkingResult {
                    host_veth: "cali0123456789a".into(),
                    container_mac: FINISHED_MAC.to_uppercase(),
                    container_index: 2,
                }),
            }
        }

        async fn remove(self) -> Result<(), DataplaneError> {
            self.0.log.borrow_mut().push("remove");
            self.0.standing.set(self.0.standing.get() - 1);
            Ok(())
        }

        fn known_mac(&self, _addrs: &AddressRequest) -> Option<String> {
            self.0.known_mac.map(str::to_string)
        }
    }

    pub fn veth() -> VethRequest {
        VethRequest {
            netns_path: "/run/netns/pod".into(),
            ifname: "eth0".into(),
            host_veth: "cali0123456789a".into(),
            mtu: 1450,
            num_queues: 0,
            container_mac: None,
            families: None,
        }
    }

    /// Runs the stage through `build` and `finish` as far as they succeed, then hands what
    /// stands to the rollback; the fake's log.
    fn run(dp: FakeDataplane) -> (bool, Vec<&'static str>) {
        let log = dp.log.clone();
        let wep = WorkloadEndpoint::new("WorkloadEndpoint", "w", Some("ns"), Default::default());
        let annotations = BTreeMap::new();
        let pod = PodFacts {
            ips: &[],
            endpoint: &wep,
            annotations: &annotations,
        };
        let addrs = AddressRequest::default();
        let ok = crate::call::client::block_on(async {
            let (mut stage, built) = Stage::Unbuilt(dp).build(veth()).await;
            let ok = match built {
                Ok(()) => {
                    let (next, finished) = stage.finish(&addrs, &pod).await;
                    stage = next;
                    finished.is_ok()
                }
                Err(_) => false,
            };
            // A failure: what stands is removed.
            if !ok {
                if let Some(interface) = stage.take_for_removal() {
                    interface.remove().await.unwrap();
                }
            }
            ok
        })
        .unwrap();
        let log = log.borrow().clone();
        (ok, log)
    }

    /// Every sequence of success and failure: a failed step removes what it made itself, so
    /// the rollback removes only what a step before it built; a success removes nothing.
    #[test]
    fn every_sequence_leaves_the_interface_or_nothing() {
        type Case = (bool, bool, bool, &'static [&'static str]);
        let cases: [Case; 3] = [
            // fail_build, fail_finish, ok, log
            (false, false, true, &["build", "finish"]),
            (true, false, false, &["build"]),
            (false, true, false, &["build", "finish"]),
        ];
        for (fail_build, fail_finish, ok, log) in cases {
            let dp = FakeDataplane {
                fail_build,
                fail_finish,
                ..Default::default()
            };
            let case = format!("build {fail_build}, finish {fail_finish}");
            assert_eq!(run(dp), (ok, log.to_vec()), "{case}");
        }
    }

    #[test]
    fn steps_out_of_order_are_refused() {
        crate::call::client::block_on(async {
            let (stage, first) = Stage::Unbuilt(FakeDataplane::default()).build(veth()).await;
            first.unwrap();
            let (stage, twice) = stage.build(veth()).await;
            assert!(matches!(twice, Err(DataplaneError::Internal(_))));
            assert!(stage.take_for_removal().is_none());
            let wep = WorkloadEndpoint::new("WorkloadEndpoint", "w", None, Default::default());
            let annotations = BTreeMap::new();
            let pod = PodFacts {
                ips: &[],
                endpoint: &wep,
                annotations: &annotations,
            };
            let (_, early) = Stage::Unbuilt(FakeDataplane::default())
                .finish(&AddressRequest::default(), &pod)
                .await;
            assert!(matches!(early, Err(DataplaneError::Internal(_))));
        })
        .unwrap();
    }
}
