//! Tokens at upgrade, at join, on refresh and at expiry.

use std::time::Duration;

use crate::support::*;
use serde_json::json;

async fn http_status(s: &Server, apikey: &str) -> (u16, String) {
    let url = s.ws_url("2.0.0", apikey);
    match tokio_tungstenite::connect_async(&url).await {
        Ok(_) => (101, String::new()),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).to_string())
                .unwrap_or_default();
            (resp.status().as_u16(), body)
        }
        Err(e) => panic!("unexpected {e}"),
    }
}

// {"alg":"none","typ":"JWT"} . {"role":"anon","exp":9999999999}
/// An ES256 token whose `kid` no JWKS of this front has (exp 2100).
const UNKNOWN_KID: &str = "eyJhbGciOiJFUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6Im5vcGUifQ.eyJyb2xlIjoiYW5vbiIsImV4cCI6NDEwMjQ0NDgwMH0.c2ln";

const ALG_NONE: &str =
    "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJyb2xlIjoiYW5vbiIsImV4cCI6OTk5OTk5OTk5OX0.";

#[tokio::test]
async fn bad_apikeys_get_401_at_upgrade() {
    let s = start().await;
    assert_eq!(http_status(&s, &anon()).await.0, 101);
    let expired = token(json!({"role":"anon","exp": now() - 30}));
    let wrong = token_with("another-secret", json!({"role":"anon","exp": now() + 30}));
    for key in [
        expired.as_str(),
        ALG_NONE,
        wrong.as_str(),
        UNKNOWN_KID,
        "",
        "garbage",
    ] {
        let (status, body) = http_status(&s, key).await;
        assert_eq!(status, 401, "{key}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"].is_string(), "{body}");
    }
    let (_, body) = http_status(&s, &expired).await;
    assert!(body.contains("Token has expired"), "{body}");
}

#[tokio::test]
async fn bad_join_tokens_get_invalid_jwt_errors() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let cases = [
        (
            token(json!({"role":"anon","exp": now() - 12})),
            "InvalidJWTToken: Token has expired",
        ),
        (ALG_NONE.to_string(), "InvalidJWTToken: Invalid token"),
        (
            token_with("nope", json!({"role":"anon","exp": now() + 60})),
            "InvalidJWTToken: Invalid token: signature",
        ),
        (
            token(json!({"exp": now() + 60})),
            "InvalidJWTToken: Fields `role` and `exp` are required in JWT",
        ),
        (
            UNKNOWN_KID.to_string(),
            "InvalidJWTToken: Invalid token: no key \"nope\" for ES256",
        ),
    ];
    for (i, (tok, want)) in cases.iter().enumerate() {
        let (_, f) = c
            .join(&format!("realtime:r{i}"), pg_config(json!([])), Some(tok))
            .await;
        assert_eq!(f[4]["status"], "error");
        let reason = f[4]["response"]["reason"].as_str().unwrap();
        assert!(reason.starts_with(want), "{reason} vs {want}");
    }
    assert!(s.worker.registered().is_empty());
    // HS384 (and HS512) with the project's secret are accepted, as Supabase does.
    let hs384 = token_alg(Algorithm::HS384, json!({"role":"anon","exp": now() + 60}));
    let (_, f) = c
        .join("realtime:hs384", pg_config(json!([])), Some(&hs384))
        .await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    // Without access_token the apikey is used.
    let (_, f) = c.join("realtime:ok", pg_config(json!([])), None).await;
    assert_eq!(f[4]["status"], "ok");
}

#[tokio::test]
async fn access_token_refresh_reregisters_with_new_claims() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let t1 = user("u1");
    let (jr, _) = c
        .join(
            "realtime:room",
            pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
            Some(&t1),
        )
        .await;
    assert_eq!(c.recv().await.event(), "system");
    // Unchanged, null and sb_ keys are ignored.
    for tok in [json!(t1), json!(null), json!("sb_publishable_xyz")] {
        c.send(
            Some(&jr),
            Some("9"),
            "realtime:room",
            "access_token",
            json!({"access_token": tok}),
        )
        .await;
    }
    c.assert_silent(Duration::from_millis(200)).await;
    assert_eq!(s.worker.register_calls().len(), 1);

    let t2 = token(json!({"role":"authenticated","sub":"u1","exp": now() + 7200, "v": 2}));
    c.send(
        Some(&jr),
        Some("10"),
        "realtime:room",
        "access_token",
        json!({"access_token": t2}),
    )
    .await;
    let sys = c.recv().await;
    assert_eq!(sys.event(), "system");
    assert_eq!(sys.payload()["message"], "Subscribed to PostgreSQL");
    let calls = s.worker.register_calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1][0].id, calls[0][0].id);
    assert_eq!(calls[1][0].claims["v"], 2);
    // The channel still delivers.
    s.change("t", "INSERT", json!({"id": 1}), &[calls[0][0].id.clone()])
        .await;
    assert_eq!(c.recv().await.event(), "postgres_changes");

    // A bad token shuts the channel: system error, then phx_close.
    let bad = token(json!({"role":"authenticated","exp": now() - 5}));
    c.send(
        Some(&jr),
        Some("11"),
        "realtime:room",
        "access_token",
        json!({"access_token": bad}),
    )
    .await;
    let sys = c.recv().await;
    assert_eq!(sys.frame()[0], json!(jr));
    assert_eq!(sys.payload()["extension"], "system");
    assert_eq!(sys.payload()["status"], "error");
    assert!(sys.payload()["message"]
        .as_str()
        .unwrap()
        .starts_with("Token has expired"));
    assert_eq!(
        c.recv().await.frame(),
        &json!([jr, jr, "realtime:room", "phx_close", {}])
    );
    s.wait_for("unregister", |s| s.worker.unregistered().len() == 1)
        .await;
}

#[tokio::test]
async fn token_expiry_closes_the_channel() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let short = token(json!({"role":"anon","exp": now() + 2}));
    let (jr, _) = c
        .join(
            "realtime:room",
            pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
            Some(&short),
        )
        .await;
    assert_eq!(c.recv().await.event(), "system");
    let sys = tokio::time::timeout(Duration::from_secs(5), c.recv())
        .await
        .unwrap();
    assert_eq!(sys.frame()[0], json!(jr));
    assert_eq!(sys.frame()[3], "system");
    assert_eq!(sys.payload()["extension"], "system");
    assert_eq!(sys.payload()["status"], "error");
    assert_eq!(sys.payload()["channel"], "room");
    let msg = sys.payload()["message"].as_str().unwrap();
    assert!(
        msg.starts_with("Token has expired") && msg.ends_with("seconds ago"),
        "{msg}"
    );
    assert_eq!(
        c.recv().await.frame(),
        &json!([jr, jr, "realtime:room", "phx_close", {}])
    );
    assert_eq!(s.worker.unregistered().len(), 1);
    // The socket itself lives on.
    c.heartbeat_ok().await;
}

#[tokio::test]
async fn projects_are_selected_by_ref_and_isolated() {
    let s = start().await;
    s.front.projects().insert("p2", "p2_schema", "p2-secret");
    let key2 = token_with(
        "p2-secret",
        json!({"role":"anon","exp": now() + 60, "ref": "p2"}),
    );
    let mut c = connect(&s.ws_url("2.0.0", &key2)).await;
    // A default-project token cannot join on a p2 socket.
    let (_, f) = c
        .join("realtime:x", pg_config(json!([])), Some(&anon()))
        .await;
    assert_eq!(f[4]["status"], "error");
    // Nor can p2 ask for the default project's schema: refused before the worker hears
    // of it.
    let (_, f) = c
        .join(
            "realtime:z",
            pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
            None,
        )
        .await;
    assert_eq!(f[4]["status"], "error", "{f}");
    let reason = f[4]["response"]["reason"].as_str().unwrap();
    assert!(
        reason.starts_with(
            "Unauthorized: You do not have permissions to read from schema \"public\""
        ),
        "{reason}"
    );
    assert!(s.worker.registered().is_empty());
    let (_, f) = c
        .join(
            "realtime:y",
            pg_config(json!([{"event":"*","schema":"p2_schema","table":"t"}])),
            None,
        )
        .await;
    assert_eq!(f[4]["status"], "ok");
    assert_eq!(s.worker.registered()[0].project, "p2");
    // A default-project event naming p2's subscription is not delivered.
    assert_eq!(c.recv().await.event(), "system");
    s.change("t", "INSERT", json!({"id": 1}), &s.worker.ids_for("t"))
        .await;
    c.assert_silent(Duration::from_millis(200)).await;
}
