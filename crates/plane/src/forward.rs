//! `_forward`: the Service address of the API server (10.0.0.1:443, the `kubernetes` Service)
//! inside the real node's network namespace, forwarded to kube-apiserver on 127.0.0.1.
//!
//! kube-apiserver listens on 127.0.0.1 only (nothing of the plane listens on the machine's
//! other addresses). The kubelet and every Pod of the real node reach it at the ClusterIP of
//! the `kubernetes` Service, as in a cluster with kube-proxy: this process binds that address
//! inside the node's namespace, then returns to the machine's namespace to connect to
//! 127.0.0.1. TLS passes through untouched (the API server's certificate names 10.0.0.1).

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::Path;
use std::thread;

use anyhow::{Context, Result};
use rustix::thread::{LinkNameSpaceType, move_into_link_name_space};

use crate::launch::read_port;
use crate::log::log;
use crate::realnode::{self, SERVICE_IP};

/// Runs until killed: accepts inside the node's namespace, connects on the machine's.
pub(crate) fn run(dir: &Path) -> Result<()> {
    let node = realnode::Node::read(dir)?;
    let host = File::open("/proc/self/ns/net").context("cannot open this network namespace")?;
    let netns = File::open(node.netns_path())
        .with_context(|| format!("cannot open {}", node.netns_path().display()))?;
    move_into_link_name_space(netns.as_fd(), Some(LinkNameSpaceType::Network))
        .context("cannot enter the node's network namespace")?;
    let listen: SocketAddr = format!("{SERVICE_IP}:443").parse()?;
    let listener = TcpListener::bind(listen);
    // Back before anything else happens: connections to the API server leave from here.
    move_into_link_name_space(host.as_fd(), Some(LinkNameSpaceType::Network))
        .context("cannot return to the machine's network namespace")?;
    let listener = listener.with_context(|| format!("cannot listen on {listen} in the node"))?;
    log(format_args!(
        "forwarding {listen} in {} to kube-apiserver",
        node.netns
    ));
    for stream in listener.incoming() {
        let Ok(inbound) = stream else { continue };
        // The port is read for each connection: a restarted API server keeps its port, and a
        // missing file only fails this one connection.
        let Ok(port) = read_port(dir, "kube-apiserver") else {
            continue;
        };
        thread::spawn(move || {
            if let Ok(outbound) = TcpStream::connect(("127.0.0.1", port)) {
                pipe(inbound, outbound);
            }
        });
    }
    Ok(())
}

/// Copies both ways until either side closes.
fn pipe(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    let up = thread::spawn(move || copy(a, b));
    copy(b2, a2);
    let _ = up.join();
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
