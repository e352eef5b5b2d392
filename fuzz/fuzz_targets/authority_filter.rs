//! The HTTP/2 `:authority` filter: every byte a local client (or, with `serve.tcp`, an
//! allowed TCP peer) sends passes through it before h2 parses it. Whatever arrives, in
//! whatever pieces: no panic, an end; a stream that is not HTTP/2 passes unchanged; and the
//! filter's output needs no second fix (filtering it again changes nothing), so what it
//! hands h2 is what h2 accepts or exactly what the client sent.
#![no_main]

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use cube_csi_bridge::transport::authority_filter::AuthorityFix;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};

/// A client that sends `data` `step` bytes at a time.
struct Pieces<'a> {
    data: &'a [u8],
    step: usize,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.step.min(self.data.len()).min(buf.remaining());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Everything the filter passes on for `data` sent in pieces of `step` bytes.
fn filtered(data: &[u8], step: usize) -> Vec<u8> {
    let mut fix = AuthorityFix::new(Pieces { data, step });
    let mut cx = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let mut buf = ReadBuf::new(&mut chunk);
        match Pin::new(&mut fix).poll_read(&mut cx, &mut buf) {
            Poll::Ready(Ok(())) if buf.filled().is_empty() => return out,
            Poll::Ready(Ok(())) => out.extend_from_slice(buf.filled()),
            other => panic!("a client that never blocks got {other:?}"),
        }
        // Even a rewrite of indexed references stays within its header-list budget.
        assert!(out.len() <= data.len() * 64 + (1 << 20), "output grew without bound");
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&first, data)) = input.split_first() else {
        return;
    };
    let step = usize::from(first).max(1);
    let out = filtered(data, step);
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    if !data.starts_with(PREFACE) {
        assert_eq!(out, data, "not HTTP/2, yet changed");
    }
    // Pieces of another size give the same stream.
    assert_eq!(filtered(data, 4096), out, "depends on how the bytes arrived");
    assert_eq!(filtered(&out, step), out, "its own output needed another fix");
});
