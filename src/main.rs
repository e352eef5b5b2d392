//! The cube-csi-bridge executable: parse the command line, start logging, dispatch.

fn main() -> std::process::ExitCode {
    cube_csi_bridge::cli::main(std::env::args_os().collect())
}
