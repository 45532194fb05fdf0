//! A fake `IpamDriver` for the plugin's unit tests: it gives the addresses it is told to,
//! and logs what it is asked (in a log it can share with a fake dataplane).

use std::cell::RefCell;
use std::net::IpAddr;
use std::rc::Rc;

use super::{AddHints, GcScope, IpamDriver};
use crate::error::{Error, Result};
use crate::skel::result::IpConfig;
use crate::skel::{CmdArgs, CniResult};

#[derive(Default)]
pub struct FakeIpam {
    /// The addresses ADD returns (CIDRs).
    pub ips: Vec<&'static str>,
    /// DEL fails with this text.
    pub fail_del: Option<&'static str>,
    pub log: Rc<RefCell<Vec<&'static str>>>,
    pub given_back: RefCell<Vec<IpAddr>>,
}

impl IpamDriver for FakeIpam {
    type View = ();

    async fn read_view(&self) {}

    async fn add(&self, _args: &CmdArgs, _view: (), _hints: AddHints<'_>) -> Result<CniResult> {
        self.log.borrow_mut().push("ipam add");
        let mut result = CniResult::default();
        for ip in &self.ips {
            let address = ip
                .parse()
                .map_err(|_| Error::msg(format!("bad test CIDR {ip}")))?;
            result.ips.push(IpConfig {
                address,
                gateway: None,
                interface: None,
            });
        }
        Ok(result)
    }

    async fn del(&self, _args: &CmdArgs) -> Result<()> {
        self.log.borrow_mut().push("ipam del");
        match self.fail_del {
            Some(text) => Err(Error::msg(text)),
            None => Ok(()),
        }
    }

    async fn give_back(&self, _args: &CmdArgs, ips: &[IpAddr]) {
        self.log.borrow_mut().push("ipam give back");
        self.given_back.borrow_mut().extend_from_slice(ips);
    }

    async fn check(&self, _args: &CmdArgs, _prev: &CniResult) -> Result<()> {
        Ok(())
    }

    async fn status(&self, _args: &CmdArgs) -> Result<()> {
        Ok(())
    }

    async fn gc(&self, _args: &CmdArgs, _scope: &GcScope<'_>) -> Vec<Error> {
        Vec::new()
    }
}
