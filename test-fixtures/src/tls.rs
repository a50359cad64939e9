//! A throwaway PKI for TLS tests: a CA, a server certificate and a client
//! certificate (for mutual TLS) signed by it, made with rcgen when the test
//! runs and written as PEM files to a temporary directory removed on drop.
//! Certificates are never checked in, so none can expire or leak a key.
//!
//! It owns only the certificates: how a test's server or client is
//! configured with them (tonic, rustls, the agent's own options) stays in
//! the test.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tempfile::TempDir;

/// The client certificate's name (common name and subject alternative name).
pub const CLIENT_NAME: &str = "agent-1";

/// A CA and the server and client certificates it signed.
///
/// The directory ([`TestPki::path`]) holds `ca.pem` (the CA certificate),
/// `client.pem` and `client.key` (the client certificate and its PKCS#8
/// key); the test may add its own files there. The server's certificate and
/// key are given in memory, as PEM and as DER.
pub struct TestPki {
    dir: TempDir,
    /// The CA certificate, PEM.
    pub ca_pem: String,
    /// The server certificate, PEM.
    pub server_cert_pem: String,
    /// The server's private key, PKCS#8 PEM.
    pub server_key_pem: String,
    /// The server certificate, DER.
    pub server_cert_der: Vec<u8>,
    /// The server's private key, PKCS#8 DER.
    pub server_key_der: Vec<u8>,
}

impl TestPki {
    /// A new CA with a server certificate for `server_names` (DNS names or
    /// IP addresses; the first is also the common name) and a client
    /// certificate for [`CLIENT_NAME`].
    pub fn new(server_names: &[&str]) -> Self {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "stackscope test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf = |names: &[&str], usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().expect("key");
            let mut params =
                CertificateParams::new(names.iter().map(|&n| n.to_owned()).collect::<Vec<_>>())
                    .expect("certificate parameters");
            if let Some(&name) = names.first() {
                params.distinguished_name.push(DnType::CommonName, name);
            }
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &issuer).expect("certificate");
            (cert, key)
        };
        let (server_cert, server_key) = leaf(server_names, ExtendedKeyUsagePurpose::ServerAuth);
        let (client_cert, client_key) = leaf(&[CLIENT_NAME], ExtendedKeyUsagePurpose::ClientAuth);

        let dir = tempfile::tempdir().expect("temporary directory");
        let ca_pem = ca_cert.pem();
        for (name, pem) in [
            ("ca.pem", ca_pem.clone()),
            ("client.pem", client_cert.pem()),
            ("client.key", client_key.serialize_pem()),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        Self {
            dir,
            ca_pem,
            server_cert_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
            server_cert_der: server_cert.der().to_vec(),
            server_key_der: server_key.serialize_der(),
        }
    }

    /// A file in the PKI's directory (`ca.pem`, `client.pem`, `client.key`,
    /// or one the test wrote).
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }
}
