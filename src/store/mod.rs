//! Persistent state: the controller store (Cube volume → CSI volume) and the node journal
//! (what is staged and published on this node), plus the atomic-file helper both rely on.

pub mod controller;
pub mod fsutil;
pub mod journal;

pub use controller::{
    ControllerStore, DeletionPolicy, EmbeddedStore, StoreError, VolumeRecord, VolumeState,
};
pub use journal::{NodeJournal, NodeRecord, Step};
