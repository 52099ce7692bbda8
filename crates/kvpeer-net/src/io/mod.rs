//! How any of our sockets is driven: the non-blocking steps every driver takes on a socket
//! ([`sockio`]).

pub(crate) mod sockio;
