//! Type OID → `typname` (`int4`, `_text`, an enum's own name …), as the realtime protocol
//! names column types.

use std::collections::HashMap;

use tokio_postgres::Client;

#[derive(Default)]
pub struct TypeCache {
    names: HashMap<u32, String>,
}

impl TypeCache {
    /// Load every type of the database (a few hundred rows).
    pub async fn load(client: &Client) -> Result<TypeCache, tokio_postgres::Error> {
        let mut cache = TypeCache::default();
        cache.reload(client).await?;
        Ok(cache)
    }

    pub async fn reload(&mut self, client: &Client) -> Result<(), tokio_postgres::Error> {
        let rows = client
            .query("SELECT oid, typname::text FROM pg_type", &[])
            .await?;
        self.names = rows
            .iter()
            .map(|r| (r.get::<_, u32>(0), r.get::<_, String>(1)))
            .collect();
        Ok(())
    }

    pub fn get(&self, oid: u32) -> Option<&str> {
        self.names.get(&oid).map(String::as_str)
    }

    pub fn contains(&self, oid: u32) -> bool {
        self.names.contains_key(&oid)
    }
}
