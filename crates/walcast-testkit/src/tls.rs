//! Throwaway certificates for TLS tests, made with the `openssl` command: a CA, a server
//! certificate it signed for `localhost` and `127.0.0.1`, and a second, unrelated CA.

use std::path::PathBuf;
use std::process::Command;

use tempfile::TempDir;

use crate::KitError;

/// PEM files in a temporary directory (deleted on drop).
pub struct TestCerts {
    pub ca: PathBuf,
    /// A CA that signed nothing here: trusting only it must fail.
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    _dir: TempDir,
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
            other_ca: d.join("other-ca.crt"),
            server_cert: d.join("server.crt"),
            server_key: d.join("server.key"),
            _dir: dir,
        })
    }
}
