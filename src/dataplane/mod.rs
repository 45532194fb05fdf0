//! The Linux dataplane: veth pair, MACs, addresses, routes and sysctls inside and outside the
//! pod's network namespace. Entry points: `do_networking` and `clean_up_namespace`.
