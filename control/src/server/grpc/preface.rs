//! The client's HTTP/2 preface, read with a deadline before hyper takes the
//! connection, then handed back to it.
//!
//! Why: hyper's HTTP/2 server waits for the 24-byte preface without end,
//! and its keep-alive pings (which close a connection whose peer stopped
//! answering) begin only after it. A client that connected and sent
//! nothing, or half a preface (a port scanner, a load balancer's TCP
//! check that never closes, a host that vanished mid-handshake), held a
//! task and a file descriptor for the life of the daemon. Now it has
//! [`PREFACE_WAIT`] to send its preface, then the connection is closed.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// How long a new connection has to send its HTTP/2 preface.
pub const PREFACE_WAIT: Duration = Duration::from_secs(10);

/// `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`: what an HTTP/2 client sends first.
const PREFACE_LEN: usize = 24;

/// `T` whose first bytes, already read, are read again.
#[derive(Debug)]
pub struct Replay<T> {
    io: T,
    head: [u8; PREFACE_LEN],
    at: usize,
}

/// Reads the first [`PREFACE_LEN`] bytes of `io` within `wait`, and gives
/// back a `Replay` that hands them to the next reader (hyper checks them).
pub async fn read<T: AsyncRead + Unpin>(mut io: T, wait: Duration) -> io::Result<Replay<T>> {
    let mut head = [0; PREFACE_LEN];
    match tokio::time::timeout(wait, io.read_exact(&mut head)).await {
        Ok(Ok(_)) => Ok(Replay { io, head, at: 0 }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no HTTP/2 preface within {wait:?}"),
        )),
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Replay<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < PREFACE_LEN {
            let n = (PREFACE_LEN - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.head[at..at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Replay<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// The preface read first is read again, whole, then the rest; in
    /// pieces as small as the reader's buffer.
    #[tokio::test]
    async fn the_preface_read_is_read_again_then_the_rest() {
        let (mut client, server) = tokio::io::duplex(64);
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nafter")
            .await
            .unwrap();
        drop(client);
        let mut r = read(server, Duration::from_secs(30)).await.unwrap();
        let mut first = [0; 5];
        r.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"PRI *");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b" HTTP/2.0\r\n\r\nSM\r\n\r\nafter");
    }

    /// Half a preface, then silence: refused after the wait.
    #[tokio::test(start_paused = true)]
    async fn half_a_preface_then_silence_is_refused() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b"PRI * HTTP/2.0").await.unwrap();
        let e = read(server, PREFACE_WAIT).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(
            e.to_string().contains("no HTTP/2 preface within 10s"),
            "{e}"
        );
        drop(client);
    }
}
