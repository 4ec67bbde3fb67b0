//! A socket that tells HTTP/2 it has no vectored writes, so that small
//! DATA frames are copied into one write buffer instead of each written
//! on its own.
//!
//! Why: h2's frame writer copies a DATA frame's payload into its 16 KiB
//! write buffer only when the payload is short — 256 bytes when the socket
//! takes vectored writes, 1,024 when it does not; a longer payload is
//! chained (the buffer plus the payload, one `writev`), and it holds one
//! chained frame at a time, so every such frame is flushed before the next
//! is encoded. A `Watch` event is about 400 bytes: with vectored writes
//! every event to every subscriber was one `writev` of one frame (125
//! subscribers on a connection, 125 system calls per event on the daemon
//! and as many wake-ups of the reader). Copied, the frames of one round
//! leave in a few writes of up to 16 KiB. Large messages (snapshots,
//! `ListModels` at 1,000 models) are still chained, not copied.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `T` with `is_write_vectored` false; everything else passed through.
#[derive(Debug)]
pub struct CopiedWrites<T>(pub T);

impl<T: AsyncRead + Unpin> AsyncRead for CopiedWrites<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for CopiedWrites<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        // Still vectored underneath when a caller asks (a chained large
        // frame): one system call for the head and the payload.
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
