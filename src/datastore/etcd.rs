//! etcd v3 backend: libcalico-go's key paths and its create/CAS-update/CAS-delete transactions.
