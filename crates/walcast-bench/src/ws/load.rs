//! The load: single-row transactions (walcast) or emit commands (the baseline) at a steady rate.

use std::io::Write;
use std::process::ChildStdin;
use std::time::{Duration, Instant};

use super::now_micros;

/// Writes rows (walcast) or emit commands (baseline).
pub(super) enum Source {
    Pg {
        client: tokio_postgres::Client,
        stmt: tokio_postgres::Statement,
        pad: String,
    },
    Baseline(ChildStdin),
}

impl Source {
    pub(super) async fn send(&mut self, id: i64, ph: i32) -> anyhow::Result<()> {
        match self {
            Source::Pg { client, stmt, pad } => {
                client.execute(&*stmt, &[&id, &ph, &*pad]).await?;
            }
            Source::Baseline(stdin) => {
                writeln!(stdin, "{id} {ph}")?;
                stdin.flush()?;
            }
        }
        Ok(())
    }
}

/// Send `rate` events per second for `secs`, ids from `*next`; returns (sent, start µs).
pub(super) async fn steady(
    src: &mut Source,
    next: &mut i64,
    ph: usize,
    rate: f64,
    secs: u64,
) -> anyhow::Result<(u64, i64)> {
    let total = (rate * secs as f64).round().max(1.0) as u64;
    let started = Instant::now();
    let start_us = now_micros();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut sent = 0u64;
    while sent < total {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * rate) as u64 + 1).min(total);
        while sent < due {
            src.send(*next, ph as i32).await?;
            *next += 1;
            sent += 1;
        }
    }
    Ok((sent, start_us))
}
