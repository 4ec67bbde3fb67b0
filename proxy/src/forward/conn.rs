//! Connections to engines that know how many exchanges they carried, so a
//! failure on a reused pooled connection (the engine closed it as the
//! request went out) can be told from one on a fresh connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{
    CaptureConnection, Connected, Connection, HttpConnector,
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Exchanges a connection has carried, shared by every request it serves.
#[derive(Debug, Clone, Default)]
pub struct Uses(Arc<AtomicU32>);

impl Uses {
    /// Counts one exchange; true when the connection had carried one before.
    pub fn count(&self) -> bool {
        self.0.fetch_add(1, Ordering::Relaxed) > 0
    }
}

/// The [`Uses`] of the connection a request went out on, if it got one.
pub fn uses(capture: &CaptureConnection) -> Option<Uses> {
    let meta = capture.connection_metadata();
    let connected = meta.as_ref()?;
    let mut ext = http::Extensions::new();
    connected.get_extras(&mut ext);
    ext.get::<Uses>().cloned()
}

/// [`HttpConnector`] whose connections carry a [`Uses`].
#[derive(Debug, Clone)]
pub struct CountingConnector {
    inner: HttpConnector,
}

impl CountingConnector {
    pub fn new(inner: HttpConnector) -> Self {
        Self { inner }
    }
}

/// One TCP connection and its use count.
#[derive(Debug)]
pub struct CountedConn {
    io: TokioIo<TcpStream>,
    uses: Uses,
}

impl Connection for CountedConn {
    fn connected(&self) -> Connected {
        self.io.connected().extra(self.uses.clone())
    }
}

impl Read for CountedConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl Write for CountedConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}

type ConnectError = <HttpConnector as tower::Service<Uri>>::Error;

impl tower::Service<Uri> for CountingConnector {
    type Response = CountedConn;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<CountedConn, ConnectError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::<Uri>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = tower::Service::<Uri>::call(&mut self.inner, uri);
        Box::pin(async move {
            Ok(CountedConn {
                io: connecting.await?,
                uses: Uses::default(),
            })
        })
    }
}
