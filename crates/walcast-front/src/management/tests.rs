use super::*;

#[test]
fn ids_and_bodies() {
    for ok in ["0b7c6f0e-1c1a-4a53-9a1e-3f0a1f5d2c11", "p1", "a_b-C"] {
        assert!(check_id(ok).is_ok(), "{ok}");
    }
    let long = "a".repeat(65);
    for bad in [
        "",
        "default",
        "x' OR '1'='1",
        "../default",
        "a/b",
        "p1;DROP TABLE walcast.projects",
        "%2e%2e",
        long.as_str(),
    ] {
        let e = check_id(bad).err().map(|e| (e.status, e.error));
        assert_eq!(e, Some((StatusCode::BAD_REQUEST, "invalid_id")), "{bad}");
    }
    assert!(body_object(b"").unwrap().is_empty());
    assert!(body_object(b"[1]").is_err());
    let o = body_object(br#"{"name":"x","privat_only":true}"#).unwrap();
    assert!(fields(&o, &["name", "private_only"]).is_err());
    let o = body_object(br#"{"suspended":"yes"}"#).unwrap();
    assert!(opt_bool(&o, "suspended").is_err());
}

#[test]
fn a_limit_is_absent_null_or_a_whole_number_in_range() {
    let limit = |body: &str| opt_limit(&body_object(body.as_bytes()).unwrap());
    assert_eq!(limit("{}").unwrap(), None, "absent: unchanged");
    assert_eq!(
        limit(r#"{"max_concurrent_users":null}"#).unwrap(),
        Some(None)
    );
    assert_eq!(
        limit(r#"{"max_concurrent_users":0}"#).unwrap(),
        Some(Some(0))
    );
    assert_eq!(
        limit(r#"{"max_concurrent_users":2147483647}"#).unwrap(),
        Some(Some(i32::MAX as u32))
    );
    for bad in [
        "-1",
        "2147483648",
        "4294967296",
        "18446744073709551616",
        "1e3",
        "2.5",
        "3.0",
        "\"10\"",
        "true",
        "[1]",
        "{\"n\":1}",
        "\"default\"",
    ] {
        let e = limit(&format!(r#"{{"max_concurrent_users":{bad}}}"#))
            .err()
            .map(|e| (e.status, e.error));
        assert_eq!(
            e,
            Some((StatusCode::UNPROCESSABLE_ENTITY, "invalid_body")),
            "{bad}"
        );
    }
}

#[test]
fn views_show_the_limit_and_the_one_in_force() {
    let p = ProjectRecord {
        id: "p".into(),
        ..ProjectRecord::default()
    };
    let v = with_effective_limit(project_view(&p), &p, 10_000);
    assert_eq!(v["max_concurrent_users"], Value::Null);
    assert_eq!(v["effective_max_concurrent_users"], 10_000);
    let p = ProjectRecord {
        max_concurrent_users: Some(0),
        ..p
    };
    let v = with_effective_limit(project_view(&p), &p, 10_000);
    assert_eq!(v["max_concurrent_users"], 0);
    assert_eq!(v["effective_max_concurrent_users"], 0);
}

/// The OpenAPI file and the router agree: the same paths, each answering exactly the
/// methods the file lists (a request without the key gets 401, any other method 405),
/// each operation with the statuses of [`RESPONSES`].
#[tokio::test]
async fn the_openapi_file_matches_the_router() {
    let doc: Value =
        serde_json::from_str(include_str!("../../../../docs/management-api.json")).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let mut in_file: Vec<&str> = paths.keys().map(String::as_str).collect();
    in_file.sort_unstable();
    let mut served = vec![PROJECTS, PROJECT, ROTATE];
    served.sort_unstable();
    assert_eq!(in_file, served);

    let m = Management::new(
        Projects::new("s"),
        Bus::local(16),
        "operator-key-for-the-openapi-test-0123456789",
        (Duration::from_secs(60), 10_000),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(listener, routes(Arc::new(m))).await.unwrap();
    });
    let mut ops = Vec::new();
    for (path, item) in paths {
        let url = path.replace("{id}", "p1");
        for method in ["GET", "POST", "PATCH", "DELETE", "PUT"] {
            let op = item.get(method.to_lowercase());
            let got = status(addr, method, &url).await;
            let want = if op.is_some() { 401 } else { 405 };
            assert_eq!(got, want, "{method} {path}");
            if let Some(op) = op {
                let id = op["operationId"].as_str().unwrap().to_string();
                let mut codes: Vec<u16> = op["responses"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(|c| c.parse().unwrap())
                    .collect();
                codes.sort_unstable();
                ops.push((id, codes));
            }
        }
    }
    assert_eq!(status(addr, "GET", "/management/v1/other").await, 404);
    ops.sort();
    let mut want: Vec<(String, Vec<u16>)> = RESPONSES
        .iter()
        .map(|(op, codes)| (op.to_string(), codes.to_vec()))
        .collect();
    want.sort();
    assert_eq!(ops, want);
    server.abort();
}

/// The status of a bodiless request.
async fn status(addr: std::net::SocketAddr, method: &str, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out);
    text.split(' ').nth(1).unwrap().parse().unwrap()
}
