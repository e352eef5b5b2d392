//! Persistent state behind the core's ports: the controller store's embedded redb backend
//! (the Kubernetes one is in `k8s/`), the node journal (what is staged and published on
//! this node) with its intent log, the volume locks, the embedded store's record key, the
//! state dir's owner, and the file helpers they rely on.

pub mod embedded;
pub mod fsutil;
pub mod intents;
pub mod journal;
pub mod locks;
pub mod owner;
pub mod record_key;

pub use embedded::EmbeddedStore;
pub use journal::FileJournal;
pub use locks::FileLocks;
pub use record_key::FileKeySource;
