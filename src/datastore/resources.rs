//! The "clientv3" layer over any backend: metadata on create/update (uid, creationTimestamp),
//! resourceVersion never stored, WEP labels.
