//! What the targets share: the bridge config the checks run against.

use std::path::Path;
use std::sync::OnceLock;

use cube_csi_bridge::config::Config;

/// A node and controller config with an allow-list of two base dirs.
pub fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        Config::parse(
            "driver = \"fuzz\"\n[csi]\nendpoint = \"/run/fuzz-csi.sock\"\n\
             [node]\ndefault_volume_base_dir = \"/data/v\"\n\
             allowed_base_dirs = [\"/data/v\", \"/data/w\"]\n",
            Path::new("/fuzz.toml"),
        )
        .expect("the fuzz config parses")
    })
}
