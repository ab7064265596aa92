//! Unit tests of the project directory: verification, refreshes, limits.
use super::*;
use crate::auth::now_secs;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use walcast_bus::admin::{AdminErrorKind, AdminHandler, AdminReply, AdminRequest, ProjectRecord};
use walcast_bus::subs::BoxFuture;

fn token(secret: &str, claims: Value) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap()
}

fn anon_of(project: &str, secret: &str) -> String {
    token(
        secret,
        json!({"role": "anon", "exp": now_secs() + 60, "ref": project}),
    )
}

/// The worker's side of the project list, counting the requests.
#[derive(Default)]
struct Worker {
    projects: Mutex<Vec<ProjectRecord>>,
    requests: AtomicUsize,
    delay: Duration,
    down: std::sync::atomic::AtomicBool,
}

impl Worker {
    fn add(&self, id: &str, secret: &str) {
        self.projects.lock().unwrap().push(ProjectRecord {
            id: id.into(),
            name: id.into(),
            schema: format!("project_{id}"),
            jwt_secret: secret.into(),
            jwt_secret_previous: None,
            jwks: None,
            ..ProjectRecord::default()
        });
    }
    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl AdminHandler for Worker {
    fn handle(&self, req: AdminRequest) -> BoxFuture<Result<AdminReply, AdminError>> {
        assert_eq!(req, AdminRequest::Projects);
        self.requests.fetch_add(1, Ordering::SeqCst);
        let projects = self.projects.lock().unwrap().clone();
        let down = self.down.load(Ordering::SeqCst);
        let delay = self.delay;
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            if down {
                return Err(AdminError::new(AdminErrorKind::Unavailable, "worker down"));
            }
            Ok(AdminReply::Projects { projects })
        })
    }
}

const MIN: Duration = Duration::from_millis(300);

fn directory(worker: &Arc<Worker>) -> Projects {
    Projects::with_directory(
        "s0",
        AdminClient::local(worker.clone()),
        DirectoryConfig {
            timeout: Duration::from_secs(5),
            min_refresh: MIN,
            refresh_every: Duration::from_secs(3600),
        },
    )
}

#[tokio::test]
async fn a_stored_project_accepts_its_previous_secret_and_survives_a_bad_jwks() {
    let worker = Arc::new(Worker::default());
    worker.projects.lock().unwrap().push(ProjectRecord {
        id: "p3".into(),
        name: "p3".into(),
        schema: "project_p3".into(),
        jwt_secret: "new".into(),
        jwt_secret_previous: Some("old".into()),
        jwks: Some(r#"{"keys":[{"kty":"oct","kid":"x","k":"c2VjcmV0"}]}"#.into()),
        ..ProjectRecord::default()
    });
    let p = directory(&worker);
    for secret in ["new", "old"] {
        let v = p.verify(&anon_of("p3", secret)).await.unwrap();
        assert_eq!(v.project, "p3", "{secret}");
    }
    assert_eq!(
        p.verify(&anon_of("p3", "other")).await.unwrap_err(),
        AuthError::Signature
    );
}

#[tokio::test]
async fn verifies_and_selects_project() {
    let p = Projects::new("s1");
    p.insert("p2", "project_p2", "s2");
    let exp = now_secs() + 60;
    let v = p
        .verify(&token("s1", json!({"role":"anon","exp":exp})))
        .await
        .unwrap();
    assert_eq!(
        (v.project.as_str(), v.schema.as_str()),
        ("default", "public")
    );
    assert_eq!(v.role(), Some("anon"));
    let v = p
        .verify(&token(
            "s1",
            json!({"role":"anon","exp":exp,"ref":"default"}),
        ))
        .await
        .unwrap();
    assert_eq!(v.project, "default");
    let v = p
        .verify(&token("s2", json!({"role":"anon","exp":exp,"ref":"p2"})))
        .await
        .unwrap();
    assert_eq!(
        (v.project.as_str(), v.schema.as_str()),
        ("p2", "project_p2")
    );
    assert_eq!(
        p.verify(&token("s1", json!({"role":"anon","exp":exp,"ref":"p2"})))
            .await
            .unwrap_err(),
        AuthError::Signature
    );
    assert!(matches!(
        p.verify(&token("s1", json!({"ref":"nope"}))).await,
        Err(AuthError::UnknownProject(_))
    ));
    assert!(matches!(
        p.verify_for("default", &token("s2", json!({"ref":"p2"})))
            .await,
        Err(AuthError::WrongProject { .. })
    ));
}

#[tokio::test]
async fn refuses_expired_and_none_accepts_every_hmac_size() {
    let p = Projects::new("s1");
    let e = p
        .verify(&token("s1", json!({"role":"anon","exp":now_secs() - 12})))
        .await
        .unwrap_err();
    assert!(matches!(e, AuthError::Expired(n) if (12..=14).contains(&n)));
    // alg none: header {"alg":"none","typ":"JWT"}, claims {"role":"anon"}
    let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJyb2xlIjoiYW5vbiJ9.";
    assert!(matches!(p.verify(none).await, Err(AuthError::Malformed(_))));
    let hs512 = encode(
        &Header::new(Algorithm::HS512),
        &json!({"role":"anon"}),
        &EncodingKey::from_secret(b"s1").unwrap(),
    )
    .unwrap();
    // HS384/512 are accepted with the project's secret; public-key algorithms
    // need a JWKS key (see auth_tests).
    assert_eq!(p.verify(&hs512).await.unwrap().role(), Some("anon"));
    assert!(matches!(
        p.verify("garbage").await,
        Err(AuthError::Malformed(_))
    ));
    assert_eq!(p.verify("").await.unwrap_err(), AuthError::Missing);
    let no_role = p
        .verify(&token("s1", json!({"exp": now_secs() + 10})))
        .await
        .unwrap();
    assert_eq!(
        no_role.require_role_and_exp(),
        Err(AuthError::MissingClaims)
    );
}

#[test]
fn schemas_a_project_may_join() {
    let v = |project: &str, schema: &str| Verified {
        project: project.into(),
        schema: schema.into(),
        claims: Default::default(),
    };
    let hex = "0123456789abcdef0123456789abcdef";
    let a = v("a", &format!("project_{hex}"));
    assert!(a.allows_schema(&format!("project_{hex}")));
    assert!(a.allows_schema("*"));
    assert!(!a.allows_schema("public"));
    assert!(!a.allows_schema("project_ffffffffffffffffffffffffffffffff"));
    let d = v("default", "public");
    assert!(d.allows_schema("public"));
    assert!(d.allows_schema("My Schema"));
    assert!(d.allows_schema("*"));
    assert!(!d.allows_schema(&format!("project_{hex}")));
    assert!(d.allows_schema("project_notahexname"));
}

#[tokio::test]
async fn an_unknown_ref_refreshes_at_most_once_per_interval() {
    let worker = Arc::new(Worker::default());
    worker.add("p1", "s1");
    let p = directory(&worker);
    // First miss: refreshes at once.
    let t0 = Instant::now();
    let v = p.verify(&anon_of("p1", "s1")).await.unwrap();
    assert_eq!(
        (v.project.as_str(), v.schema.as_str()),
        ("p1", "project_p1")
    );
    assert_eq!(worker.requests(), 1);
    assert!(
        t0.elapsed() < MIN,
        "the first miss waited {:?}",
        t0.elapsed()
    );
    // Known now: no request.
    p.verify(&anon_of("p1", "s1")).await.unwrap();
    assert_eq!(worker.requests(), 1);
    // Another miss right after: waits for the interval, then asks once more.
    let e = p.verify(&anon_of("nope", "s1")).await.unwrap_err();
    assert_eq!(e, AuthError::UnknownProject("nope".into()));
    assert_eq!(worker.requests(), 2);
    assert!(
        t0.elapsed() >= MIN,
        "second refresh after {:?}",
        t0.elapsed()
    );
    // A project created since is found by the next miss.
    worker.add("p2", "s2");
    let t1 = Instant::now();
    p.verify(&anon_of("p2", "s2")).await.unwrap();
    assert_eq!(worker.requests(), 3);
    assert!(t1.elapsed() >= MIN / 2, "third refresh came too early");
    // Many misses in a row: never more than one refresh per interval.
    let t2 = Instant::now();
    for i in 0..5 {
        let e = p
            .verify(&anon_of(&format!("x{i}"), "s1"))
            .await
            .unwrap_err();
        assert!(matches!(e, AuthError::UnknownProject(_)), "{e:?}");
    }
    let refreshes = worker.requests() - 3;
    let allowed = (t2.elapsed().as_millis() / MIN.as_millis()) as usize + 1;
    assert!(
        refreshes <= allowed,
        "{refreshes} refreshes in {:?}",
        t2.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_share_one_refresh() {
    let worker = Arc::new(Worker {
        delay: Duration::from_millis(100),
        ..Worker::default()
    });
    worker.add("p1", "s1");
    let p = directory(&worker);
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let p = p.clone();
            let key = if i % 2 == 0 {
                anon_of("p1", "s1")
            } else {
                anon_of(&format!("r{i}"), "s1")
            };
            tokio::spawn(async move { p.verify(&key).await.map(|v| v.project) })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        if i.is_multiple_of(2) {
            assert_eq!(r, Ok("p1".to_string()));
        } else {
            assert!(matches!(r, Err(AuthError::UnknownProject(_))), "{r:?}");
        }
    }
    // Misses that came in while a refresh ran may need one more (it may have read
    // the list before they missed), but never one each.
    assert!(
        (1..=2).contains(&worker.requests()),
        "{} refreshes for 20 concurrent misses",
        worker.requests()
    );
}

#[tokio::test]
async fn a_worker_that_cannot_answer_keeps_known_projects() {
    let worker = Arc::new(Worker::default());
    worker.add("p1", "s1");
    let p = directory(&worker);
    p.verify(&anon_of("p1", "s1")).await.unwrap();
    worker.down.store(true, Ordering::SeqCst);
    let e = p.verify(&anon_of("p2", "s2")).await.unwrap_err();
    assert!(matches!(e, AuthError::DirectoryUnavailable(_)), "{e:?}");
    // Known projects and the default one still verify, without asking.
    let before = worker.requests();
    p.verify(&anon_of("p1", "s1")).await.unwrap();
    p.verify(&token(
        "s0",
        json!({"role": "anon", "exp": now_secs() + 60}),
    ))
    .await
    .unwrap();
    assert_eq!(worker.requests(), before);
}

#[tokio::test]
async fn the_refresh_loop_loads_at_start_and_without_a_directory_does_nothing() {
    let worker = Arc::new(Worker::default());
    worker.add("p1", "s1");
    let p = directory(&worker);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(p.clone().refresh_loop(cancel.clone()));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !p.contains("p1") {
        assert!(Instant::now() < deadline, "p1 not loaded within 5 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cancel.cancel();
    task.await.unwrap();
    assert_eq!(worker.requests(), 1);
    // Without a directory the loop returns at once.
    Projects::new("s")
        .refresh_loop(CancellationToken::new())
        .await;
}

#[tokio::test]
async fn a_rotation_and_its_windows_end_are_keys_changes_that_sessions_fail() {
    let worker = Arc::new(Worker::default());
    worker.add("p", "old-secret");
    worker.add("q", "q-secret");
    let p = directory(&worker);
    let mut events = p.events();
    let cancel = CancellationToken::new();
    tokio::spawn(p.clone().refresh_loop(cancel.clone()));
    let old = anon_of("p", "old-secret");
    tokio::time::timeout(Duration::from_secs(5), async {
        while p.check_session("p", &old).is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("loaded");
    // Rotated with a window: a keys change at once, the old key still good.
    let window_end = status::now_ms() + 400;
    {
        let mut stored = worker.projects.lock().unwrap();
        let rec = &mut stored[0];
        rec.jwt_secret = "new-secret".into();
        rec.jwt_secret_previous = Some("old-secret".into());
        rec.jwt_secret_previous_until_ms = Some(window_end);
    }
    p.refresh_now().await;
    let next = |events: &mut tokio::sync::broadcast::Receiver<ProjectEvent>| {
        let e = events.try_recv();
        e.ok()
    };
    assert_eq!(
        next(&mut events),
        Some(ProjectEvent::KeysChanged("p".into()))
    );
    assert_eq!(next(&mut events), None, "q's keys did not change");
    assert_eq!(p.check_session("p", &old), Ok(()));
    let new = anon_of("p", "new-secret");
    assert_eq!(p.check_session("p", &new), Ok(()));
    // The window's end is one more, told without a refresh; the old key then fails.
    let e = tokio::time::timeout(Duration::from_secs(5), events.recv()).await;
    assert_eq!(
        e.expect("told").unwrap(),
        ProjectEvent::KeysChanged("p".into())
    );
    assert!(status::now_ms() >= window_end);
    assert_eq!(p.check_session("p", &old), Err(AuthError::Signature));
    assert_eq!(p.check_session("p", &new), Ok(()));
    // A refresh that changes nothing tells nothing.
    p.refresh_now().await;
    assert_eq!(next(&mut events), None);
    // Suspended, then gone: sessions fail too.
    worker.projects.lock().unwrap()[0].suspended = true;
    p.refresh_now().await;
    assert!(matches!(
        p.check_session("p", &new),
        Err(AuthError::Suspended(_))
    ));
    worker.projects.lock().unwrap().remove(0);
    p.refresh_now().await;
    assert!(matches!(
        p.check_session("p", &new),
        Err(AuthError::UnknownProject(_))
    ));
    assert_eq!(p.check_session("q", &anon_of("q", "q-secret")), Ok(()));
    cancel.cancel();
}
