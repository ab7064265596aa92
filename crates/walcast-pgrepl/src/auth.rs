//! Startup and authentication (trust, cleartext, MD5, SCRAM-SHA-256 without channel
//! binding), all message and SCRAM work done by `postgres-protocol`.

use std::collections::HashMap;

use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256, SCRAM_SHA_256};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;

use crate::conn::{describe, server_error, Backend, Conn};
use crate::ReplError;

/// What the server told us after a successful startup.
pub(crate) struct Session {
    pub(crate) backend_pid: Option<i32>,
    pub(crate) parameters: HashMap<String, String>,
}

/// Send the startup packet and authenticate, then read until `ReadyForQuery`.
pub(crate) async fn startup(
    conn: &mut Conn,
    params: &[(&str, &str)],
    user: &str,
    password: Option<&[u8]>,
) -> Result<Session, ReplError> {
    frontend::startup_message(params.iter().copied(), &mut conn.wbuf)
        .map_err(|e| ReplError::Config(format!("invalid startup parameter: {e}")))?;
    conn.flush().await?;
    authenticate(conn, user, password).await?;

    let mut session = Session {
        backend_pid: None,
        parameters: HashMap::new(),
    };
    loop {
        match conn.read().await? {
            Backend::Msg(Message::BackendKeyData(body)) => {
                session.backend_pid = Some(body.process_id());
            }
            Backend::Msg(Message::ParameterStatus(body)) => {
                if let (Ok(name), Ok(value)) = (body.name(), body.value()) {
                    session.parameters.insert(name.into(), value.into());
                }
            }
            Backend::Msg(Message::ReadyForQuery(_)) => return Ok(session),
            Backend::Msg(Message::ErrorResponse(body)) => return Err(server_error(&body)),
            other => conn.ignore_or_reject(other, "startup")?,
        }
    }
}

async fn authenticate(
    conn: &mut Conn,
    user: &str,
    password: Option<&[u8]>,
) -> Result<(), ReplError> {
    loop {
        match conn.read().await? {
            Backend::Msg(Message::AuthenticationOk) => return Ok(()),
            Backend::Msg(Message::AuthenticationCleartextPassword) => {
                let pw = need_password(password, "a cleartext password")?;
                frontend::password_message(pw, &mut conn.wbuf).map_err(bad_password)?;
                conn.flush().await?;
            }
            Backend::Msg(Message::AuthenticationMd5Password(body)) => {
                let pw = need_password(password, "an MD5 password")?;
                let hash = md5_hash(user.as_bytes(), pw, body.salt());
                frontend::password_message(hash.as_bytes(), &mut conn.wbuf)
                    .map_err(bad_password)?;
                conn.flush().await?;
            }
            Backend::Msg(Message::AuthenticationSasl(body)) => {
                let mut offered = Vec::new();
                let mut mechanisms = body.mechanisms();
                while let Some(m) = mechanisms.next().map_err(|e| {
                    ReplError::Protocol(format!("malformed SASL mechanism list: {e}"))
                })? {
                    offered.push(m.to_string());
                }
                if !offered.iter().any(|m| m == SCRAM_SHA_256) {
                    return Err(ReplError::Auth(format!(
                        "server offers SASL mechanisms {offered:?}; only {SCRAM_SHA_256} \
                         (without TLS channel binding) is supported"
                    )));
                }
                let pw = need_password(password, "a SCRAM-SHA-256 password")?;
                scram(conn, pw).await?;
            }
            Backend::Msg(Message::ErrorResponse(body)) => {
                return Err(auth_error(server_error(&body)))
            }
            Backend::Msg(
                Message::AuthenticationGss
                | Message::AuthenticationSspi
                | Message::AuthenticationKerberosV5
                | Message::AuthenticationScmCredential,
            ) => {
                return Err(ReplError::Auth(
                    "server requires GSSAPI/SSPI/Kerberos/SCM authentication, which is not \
                     supported (use trust, password, md5 or scram-sha-256)"
                        .into(),
                ))
            }
            Backend::Msg(Message::NoticeResponse(_)) => {}
            other => {
                return Err(ReplError::Protocol(format!(
                    "unexpected {} during authentication",
                    describe(&other)
                )))
            }
        }
    }
}

/// The SASL exchange: client-first, server-first, client-final, server-final.
async fn scram(conn: &mut Conn, password: &[u8]) -> Result<(), ReplError> {
    // No TLS, so no channel binding: the client says so with the "n" GS2 header.
    let mut scram = ScramSha256::new(password, ChannelBinding::unsupported());
    frontend::sasl_initial_response(SCRAM_SHA_256, scram.message(), &mut conn.wbuf)
        .map_err(bad_password)?;
    conn.flush().await?;

    match conn.read().await? {
        Backend::Msg(Message::AuthenticationSaslContinue(body)) => {
            scram
                .update(body.data())
                .map_err(|e| ReplError::Auth(format!("SCRAM server-first message: {e}")))?;
        }
        Backend::Msg(Message::ErrorResponse(body)) => return Err(auth_error(server_error(&body))),
        other => {
            return Err(ReplError::Protocol(format!(
                "expected SASL continue, got {}",
                describe(&other)
            )))
        }
    }
    frontend::sasl_response(scram.message(), &mut conn.wbuf).map_err(bad_password)?;
    conn.flush().await?;

    match conn.read().await? {
        Backend::Msg(Message::AuthenticationSaslFinal(body)) => scram
            .finish(body.data())
            .map_err(|e| ReplError::Auth(format!("SCRAM server signature check failed: {e}"))),
        Backend::Msg(Message::ErrorResponse(body)) => Err(auth_error(server_error(&body))),
        other => Err(ReplError::Protocol(format!(
            "expected SASL final, got {}",
            describe(&other)
        ))),
    }
}

fn need_password<'a>(password: Option<&'a [u8]>, what: &str) -> Result<&'a [u8], ReplError> {
    password.ok_or_else(|| {
        ReplError::Auth(format!(
            "the server asks for {what} but the connection string has none"
        ))
    })
}

/// Server errors of SQLSTATE class 28 (invalid authorization) become [`ReplError::Auth`].
fn auth_error(e: ReplError) -> ReplError {
    match e {
        ReplError::Server { code, message, .. } if code.starts_with("28") => {
            ReplError::Auth(format!("{message} (SQLSTATE {code})"))
        }
        other => other,
    }
}

fn bad_password(e: std::io::Error) -> ReplError {
    ReplError::Auth(format!("cannot send password: {e}"))
}
