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

/// Each limit: absent, `null` or a whole number from 0 to 2147483647; anything else
/// refused (422) with a message naming it.
#[test]
fn every_limit_is_absent_null_or_a_whole_number_in_range() {
    for (i, k) in ProjectLimits::FIELDS.into_iter().enumerate() {
        let limit = |v: &str| {
            opt_limit(
                &body_object(format!(r#"{{"{k}":{v}}}"#).as_bytes()).unwrap(),
                k,
            )
        };
        assert_eq!(
            opt_limit(&body_object(b"{}").unwrap(), k).unwrap(),
            None,
            "absent: unchanged"
        );
        assert_eq!(limit("null").unwrap(), Some(None));
        assert_eq!(limit("0").unwrap(), Some(Some(0)));
        assert_eq!(limit("2147483647").unwrap(), Some(Some(i32::MAX as u32)));
        for bad in [
            "-1",
            "-0.0",
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
            let e = limit(bad).unwrap_err();
            assert_eq!(
                (e.status, e.error),
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid_body"),
                "{k}: {bad}"
            );
            assert!(e.message.contains(k), "{k}: {bad}: {}", e.message);
            // The same through the whole body, among other valid fields.
            let body = format!(r#"{{"name":"x","max_concurrent_users":1,"{k}":{bad}}}"#);
            assert!(
                opt_limits(&body_object(body.as_bytes()).unwrap()).is_err(),
                "{body}"
            );
        }
        let body = format!(r#"{{"{k}":7,"private_only":true}}"#);
        let changes = opt_limits(&body_object(body.as_bytes()).unwrap()).unwrap();
        let mut want = [None; LIMITS];
        want[i] = Some(Some(7));
        assert_eq!(changes.to_array(), want, "{k}");
    }
    let all = r#"{"max_concurrent_users":1,"max_joins_per_second":2,"max_channels_per_client":3,
        "max_events_per_second":null,"max_bytes_per_second":5,
        "max_presence_events_per_second":6,"max_payload_size_in_kb":0}"#;
    let changes = opt_limits(&body_object(all.as_bytes()).unwrap()).unwrap();
    assert_eq!(
        changes.to_array(),
        [
            Some(Some(1)),
            Some(Some(2)),
            Some(Some(3)),
            Some(None),
            Some(Some(5)),
            Some(Some(6)),
            Some(Some(0))
        ]
    );
}

#[test]
fn only_known_fields_are_accepted() {
    for k in ProjectLimits::FIELDS {
        assert!(
            create_fields().contains(&k) && update_fields().contains(&k),
            "{k}"
        );
    }
    assert!(!create_fields().contains(&"suspended"));
    // A project's source is chosen at its creation, never changed.
    assert!(create_fields().contains(&"source") && !update_fields().contains(&"source"));
    for bad in [
        "max_users",
        "max_concurrent_user",
        "Max_concurrent_users",
        "effective_max_concurrent_users",
        "max_payload_size_in_kb ",
        "max_channels_per_socket",
        "__proto__",
        "",
    ] {
        let body = serde_json::json!({ bad: 1 }).to_string();
        let o = body_object(body.as_bytes()).unwrap();
        for allowed in [create_fields(), update_fields()] {
            let e = fields(&o, &allowed).unwrap_err();
            assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY, "{bad:?}");
            assert!(e.message.contains(&format!("{bad:?}")), "{}", e.message);
        }
    }
}

#[test]
fn views_show_each_limit_and_the_one_in_force() {
    let defaults = defaults_of(10_000, 100);
    assert_eq!(
        defaults.to_array(),
        [
            Some(10_000),
            Some(1000),
            Some(100),
            Some(50_000),
            Some(50_000_000),
            Some(1000),
            Some(1024)
        ]
    );
    assert_eq!(
        defaults_of(u64::MAX, usize::MAX).max_concurrent_users,
        Some(u32::MAX)
    );
    let p = ProjectRecord {
        id: "p".into(),
        ..ProjectRecord::default()
    };
    let v = with_effective_limits(project_view(&p), &p, &defaults);
    for (k, d) in ProjectLimits::FIELDS.into_iter().zip(defaults.to_array()) {
        assert_eq!(v[k], Value::Null, "{k}");
        assert_eq!(v[format!("effective_{k}")], d.unwrap(), "{k}");
    }
    let own = ProjectLimits::from_array(std::array::from_fn(|i| Some(i as u32)));
    let p = ProjectRecord { limits: own, ..p };
    let v = with_effective_limits(project_view(&p), &p, &defaults);
    for (i, k) in ProjectLimits::FIELDS.into_iter().enumerate() {
        assert_eq!(
            (&v[k], &v[format!("effective_{k}")]),
            (&json!(i), &json!(i)),
            "{k}"
        );
    }
    // Never a secret.
    assert!(v.get("jwt_secret").is_none());
}

/// The OpenAPI file and the router agree: the same paths, each answering exactly the
/// methods the file lists (a request without the key gets 401, any other method 405),
/// each operation with the statuses of [`RESPONSES`].
#[tokio::test]
async fn the_openapi_file_matches_the_router() {
    let doc: Value =
        serde_json::from_str(include_str!("../../../../docs/management-api.json")).unwrap();
    check_schemas(&doc);
    let paths = doc["paths"].as_object().unwrap();
    let mut in_file: Vec<&str> = paths.keys().map(String::as_str).collect();
    in_file.sort_unstable();
    let mut served = vec![PROJECTS, PROJECT, ROTATE, SNAPSHOTS, SNAPSHOT];
    served.sort_unstable();
    assert_eq!(in_file, served);

    let m = Management::new(
        Projects::new("s"),
        Bus::local(16),
        "operator-key-for-the-openapi-test-0123456789",
        (Duration::from_secs(60), defaults_of(10_000, 100)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(listener, routes(Arc::new(m))).await.unwrap();
    });
    let mut ops = Vec::new();
    for (path, item) in paths {
        let url = path.replace("{id}", "p1").replace("{snapshot}", "1");
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

/// The request bodies' fields are those the handlers accept, and a project's fields
/// (all required) are those of its view, each limit with its type and range.
fn check_schemas(doc: &Value) {
    let schemas = &doc["components"]["schemas"];
    let props = |name: &str| props_of(schemas, name);
    assert_eq!(props("CreateProject"), sorted(create_fields()));
    assert_eq!(props("UpdateProject"), sorted(update_fields()));
    check_snapshot_schemas(schemas);
    let p = ProjectRecord::default();
    let view = with_effective_limits(project_view(&p), &p, &defaults_of(1, 1));
    let view_keys: Vec<&str> = view
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let view_keys = sorted(view_keys);
    assert_eq!(props("Project"), view_keys);
    let mut required: Vec<String> =
        serde_json::from_value(schemas["Project"]["required"].clone()).unwrap();
    required.sort();
    assert_eq!(required, view_keys);
    for k in ProjectLimits::FIELDS {
        for schema in ["CreateProject", "UpdateProject", "Project"] {
            let f = &schemas[schema]["properties"][k];
            assert_eq!(
                (&f["type"], &f["minimum"], &f["nullable"]),
                (&json!("integer"), &json!(0), &json!(true)),
                "{schema}.{k}"
            );
            assert!(
                f["description"].as_str().is_some_and(|d| !d.is_empty()),
                "{schema}.{k}"
            );
        }
        for schema in ["CreateProject", "UpdateProject"] {
            let f = &schemas[schema]["properties"][k];
            assert_eq!(f["maximum"], json!(MAX_LIMIT), "{schema}.{k}");
        }
        let e = &schemas["Project"]["properties"][format!("effective_{k}")];
        assert_eq!(e["type"], "integer", "effective_{k}");
    }
}

/// The snapshot start's fields are those the handler accepts, and a snapshot's those of
/// its view.
fn check_snapshot_schemas(schemas: &Value) {
    let props = |name: &str| props_of(schemas, name);
    assert_eq!(
        props("StartSnapshot"),
        sorted(super::snapshots::START_FIELDS.to_vec())
    );
    let record = walcast_bus::admin::SnapshotRecord {
        id: 1,
        project: "p".into(),
        schema: "public".into(),
        table: "t".into(),
        filter: String::new(),
        state: "queued".into(),
        last_key: None,
        rows_done: 0,
        chunks_done: 0,
        rows_estimate: 0,
        error: None,
    };
    let snapshot = super::snapshots::snapshot_view(&record);
    let snapshot_keys = sorted(
        snapshot
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect(),
    );
    assert_eq!(props("Snapshot"), snapshot_keys);
    let mut required: Vec<String> =
        serde_json::from_value(schemas["Snapshot"]["required"].clone()).unwrap();
    required.sort();
    assert_eq!(required, snapshot_keys);
}

/// The property names of the schema `name`, sorted.
fn props_of(schemas: &Value, name: &str) -> Vec<String> {
    let mut keys: Vec<String> = schemas[name]["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("{name}"))
        .keys()
        .cloned()
        .collect();
    keys.sort();
    keys
}

fn sorted(v: Vec<&str>) -> Vec<String> {
    let mut v: Vec<String> = v.into_iter().map(String::from).collect();
    v.sort();
    v
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

/// The fronts' defaults with these users and channels limits.
fn defaults_of(users: u64, channels: usize) -> walcast_bus::admin::ProjectLimits {
    crate::FrontConfig {
        project_max_users: users,
        max_channels_per_socket: channels,
        ..Default::default()
    }
    .project_defaults()
}
