//! CNI results: one spec-1.0 model, encoded for every supported cniVersion and parsed from
//! any of them (a delegated IPAM plugin may answer in an older version).
//! (Implementation in progress: see the skel issue.)

use std::net::IpAddr;

use crate::net::IpNet;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniResult {
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: String,
    /// 0 = not reported.
    pub mtu: u32,
    pub sandbox: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpConfig {
    pub address: IpNet,
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    pub interface: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dns {
    pub nameservers: Vec<String>,
    pub domain: String,
    pub search: Vec<String>,
    pub options: Vec<String>,
}
