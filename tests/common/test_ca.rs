//! The suites' one test CA: every TLS server a test starts (the fake and the real
//! kube-apiserver, the HTTPS proxies and their targets) serves a certificate signed by a
//! fresh [`TestCa`] for the names the test connects to; clients trust its PEM.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

/// Valid from long before to long after any run (no test depends on the clock here).
fn valid_for_the_tests(p: &mut CertificateParams) {
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(2099, 1, 1);
}

pub struct TestCa {
    pub pem: String,
    pub der: Vec<u8>,
    issuer: Issuer<'static, KeyPair>,
}

/// A server certificate and its key (PKCS #8), as PEM and DER.
pub struct ServerCert {
    pub cert_pem: String,
    pub cert_der: Vec<u8>,
    pub key_pem: String,
    pub key_der: Vec<u8>,
}

impl TestCa {
    pub fn new(common_name: &str) -> TestCa {
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, common_name);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        valid_for_the_tests(&mut ca);
        let key = KeyPair::generate().expect("CA key");
        let cert = ca.self_signed(&key).expect("self-sign the CA");
        TestCa {
            pem: cert.pem(),
            der: cert.der().to_vec(),
            issuer: Issuer::new(ca, key),
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses), signed by this CA.
    pub fn server_cert(&self, common_name: &str, names: &[&str]) -> ServerCert {
        let mut leaf =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("server certificate params");
        leaf.distinguished_name
            .push(DnType::CommonName, common_name);
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf.use_authority_key_identifier_extension = true;
        valid_for_the_tests(&mut leaf);
        let key = KeyPair::generate().expect("server key");
        let cert = leaf
            .signed_by(&key, &self.issuer)
            .expect("sign the server certificate");
        ServerCert {
            cert_pem: cert.pem(),
            cert_der: cert.der().to_vec(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }
}

impl ServerCert {
    /// A rustls server serving this certificate, offering `alpn`.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        // An explicit provider: the process-wide default is ambiguous when several are built.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![self.cert_der.clone().into()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
            )
            .expect("the server certificate");
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }
}
