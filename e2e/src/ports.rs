//! Free loopback ports, chosen at run time.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Mutex;

/// A loopback TCP port that is free now and not handed out before by this process. (Another
/// process could still take it before ours binds it; the window is short.)
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    loop {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("binding a loopback port");
        let port = listener.local_addr().expect("local address").port();
        if given.insert(port) {
            return port;
        }
    }
}

/// `127.0.0.1:<free port>`.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()))
}
