//! Throwaway certificates for TLS tests, made with the `openssl` command: a CA, a server
//! certificate it signed for `localhost` and `127.0.0.1`, a second, unrelated CA, and on
//! demand client certificates the CA signed.

use std::path::PathBuf;
use std::process::Command;

use tempfile::TempDir;

use crate::KitError;

/// PEM files in a temporary directory (deleted on drop).
pub struct TestCerts {
    pub ca: PathBuf,
    ca_key: PathBuf,
    /// A CA that signed nothing here: trusting only it must fail.
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    dir: TempDir,
}

fn openssl(args: &[&str], dir: &std::path::Path) -> Result<(), KitError> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| {
            KitError::io(
                "running openssl (install it: apt-get install openssl)".to_string(),
                e,
            )
        })?;
    if !out.status.success() {
        return Err(KitError::io(
            format!("openssl {}", args.join(" ")),
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
        ));
    }
    Ok(())
}

fn new_ca(dir: &std::path::Path, name: &str) -> Result<(), KitError> {
    let (key, crt, subj) = (
        format!("{name}.key"),
        format!("{name}.crt"),
        format!("/CN=walcast test {name}"),
    );
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &subj,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        dir,
    )
}

impl TestCerts {
    pub fn generate() -> Result<TestCerts, KitError> {
        let dir = tempfile::Builder::new()
            .prefix("walcast-certs-")
            .tempdir()
            .map_err(|e| KitError::io("creating temp dir", e))?;
        let d = dir.path();
        new_ca(d, "ca")?;
        new_ca(d, "other-ca")?;
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=localhost",
            ],
            d,
        )?;
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .map_err(|e| KitError::io("writing server.ext", e))?;
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.crt",
                "-days",
                "2",
                "-extfile",
                "server.ext",
            ],
            d,
        )?;
        Ok(TestCerts {
            ca: d.join("ca.crt"),
            ca_key: d.join("ca.key"),
            other_ca: d.join("other-ca.crt"),
            server_cert: d.join("server.crt"),
            server_key: d.join("server.key"),
            dir,
        })
    }
}

impl TestCerts {
    /// A client certificate for `name` (its common name), signed by [`TestCerts::ca`]:
    /// the certificate and its key (PKCS #8), next to the others.
    pub fn client(&self, name: &str) -> Result<(PathBuf, PathBuf), KitError> {
        let d = self.dir.path();
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(KitError::io(
                format!("client certificate name {name:?}"),
                std::io::Error::other("letters, digits and '-' only"),
            ));
        }
        let (key, csr, crt, ext) = (
            format!("client-{name}.key"),
            format!("client-{name}.csr"),
            format!("client-{name}.crt"),
            format!("client-{name}.ext"),
        );
        let subj = format!("/CN={name}");
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &subj,
            ],
            d,
        )?;
        std::fs::write(
            d.join(&ext),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n",
        )
        .map_err(|e| KitError::io("writing a client certificate's extensions", e))?;
        let ca_key = self.ca_key.display().to_string();
        let ca = self.ca.display().to_string();
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
            d,
        )?;
        Ok((d.join(crt), d.join(key)))
    }
}
