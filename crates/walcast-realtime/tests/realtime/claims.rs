//! The claims a check sets: `auth.uid()` and `auth.role()` (walcast's own, after the
//! migrations) answer what they answered when they parsed `request.jwt.claims` on every
//! call, for every shape of claim, and one group's values never reach the next group of
//! the same transaction.

use walcast_realtime::authorize::check::SET_CLAIMS;
use walcast_testkit::Postgres;

/// What 0002's helpers answered, from the claims alone: (uid, role).
const BY_CLAIMS: &str = "SELECT nullif(auth.jwt() ->> 'sub', '')::uuid::text, \
                         nullif(auth.jwt() ->> 'role', '')";
const NOW: &str = "SELECT auth.uid()::text, auth.role(), \
                   current_setting('request.jwt.claim.sub', true), \
                   current_setting('request.jwt.claim.email', true)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_helpers_read_the_claim_settings_and_answer_as_before() {
    let pg = Postgres::start().expect("postgres");
    let mut db = pg.connect().await.expect("connect");
    walcast_control::migrate::migrate(&mut db)
        .await
        .expect("migrations");
    let body: String = db
        .query_one(
            "SELECT prosrc FROM pg_proc WHERE oid = 'auth.uid()'::regprocedure",
            &[],
        )
        .await
        .expect("auth.uid()")
        .get(0);
    assert!(body.contains("request.jwt.claim.sub"), "{body}");
    let uid = "5a4b6c1e-0d1f-4e2a-9b3c-7d8e9f0a1b2c";
    let cases = [
        (
            format!(r#"{{"sub":"{uid}","role":"authenticated","email":"a@b.c"}}"#),
            Some(uid),
        ),
        (r#"{"role":"anon"}"#.to_string(), None),
        (r#"{"sub":"","role":""}"#.to_string(), None),
        (r#"{"sub":null,"role":null}"#.to_string(), None),
        (format!(r#"{{"sub":"{uid}"}}"#), Some(uid)),
        ("{}".to_string(), None),
    ];
    db.batch_execute("BEGIN").await.expect("begin");
    for (claims, want) in &cases {
        db.execute(SET_CLAIMS, &[&"authenticated", claims])
            .await
            .expect("set the claims");
        let now = db.query_one(NOW, &[]).await.expect("helpers");
        let before = db.query_one(BY_CLAIMS, &[]).await.expect("by claims");
        let (uid_now, role_now): (Option<String>, Option<String>) = (now.get(0), now.get(1));
        let (uid_before, role_before): (Option<String>, Option<String>) =
            (before.get(0), before.get(1));
        assert_eq!(uid_now.as_deref(), *want, "auth.uid() for {claims}");
        assert_eq!(
            (&uid_now, &role_now),
            (&uid_before, &role_before),
            "{claims}"
        );
        let email: Option<String> = now.get(3);
        let want_email = if claims.contains("a@b.c") {
            "a@b.c"
        } else {
            ""
        };
        assert_eq!(
            email.as_deref(),
            Some(want_email),
            "claim.email for {claims}"
        );
    }
    db.batch_execute("ROLLBACK").await.expect("rollback");
    // Outside a check, with a placeholder left empty by one: the claims still count.
    let tx =
        format!("BEGIN; SELECT set_config('request.jwt.claims', '{{\"sub\":\"{uid}\"}}', true)");
    db.batch_execute(&tx).await.expect("claims only");
    let now = db.query_one(NOW, &[]).await.expect("helpers");
    assert_eq!(now.get::<_, Option<String>>(0).as_deref(), Some(uid));
    db.batch_execute("ROLLBACK").await.expect("rollback");
}
