//! The names the dispatcher keeps its members and jobs under. On the wire each is a string;
//! from the RPC layer in, each is its own type, so a worker's id cannot be looked up among
//! clients, nor a job's name passed where a client's id belongs.

use std::fmt;

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash,
            serde::Serialize, serde::Deserialize, schemars::JsonSchema,
        )]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(name: impl Into<String>) -> Self {
                $name(name.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// For the wire.
            pub fn into_string(self) -> String {
                self.0
            }

            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<String> for $name {
            fn from(name: String) -> Self {
                $name(name)
            }
        }

        impl From<&str> for $name {
            fn from(name: &str) -> Self {
                $name(name.to_string())
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

name_type!(
    /// A worker process, as registered with a dispatcher (kept across a dispatcher restart).
    WorkerId
);

name_type!(
    /// A client (one consumer of a job), as registered with a dispatcher.
    ClientId
);

name_type!(
    /// A job: the consumers that read a pipeline's epochs together, named by their clients
    /// (a resumed job gets a new run's name from the dispatcher).
    JobName
);

name_type!(
    /// A share group: jobs of one pipeline (a sweep's trials) that take their splits from one
    /// production, named by their clients.
    ShareName
);
