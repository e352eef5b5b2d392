//! Persistent state: the controller store (Cube volume → CSI volume; a trait, with the
//! embedded redb backend here and the Kubernetes one in `k8s/`) and the node journal (what
//! is staged and published on this node), plus the file helpers both rely on.

pub mod controller;
pub mod embedded;
pub mod fsutil;
pub mod journal;

pub use controller::{
    ControllerStore, DeletionPolicy, SecretRef, StoreError, VolumeRecord, VolumeState,
};
pub use embedded::EmbeddedStore;
pub use journal::{NodeJournal, NodeRecord, Step};
