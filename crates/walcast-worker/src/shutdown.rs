//! SIGINT/SIGTERM → cancellation.

use tokio_util::sync::CancellationToken;

/// Once `signal` fires, drain `front` (see [`walcast_front::Front::drain`]), then cancel
/// `stop`: until then the HTTP server keeps answering (`/readyz` says 503) and the
/// pipeline keeps delivering to the sockets not closed yet.
pub fn drain_then_stop(
    signal: CancellationToken,
    front: walcast_front::Front,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        tokio::select! {
            _ = signal.cancelled() => front.drain().await,
            _ = stop.cancelled() => {}
        }
        stop.cancel();
    });
}

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for SIGTERM");
                        let _ = ctrl_c.await;
                        t.cancel();
                        return;
                    }
                };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown requested");
        t.cancel();
    });
    token
}
