use std::process::ExitCode;

use clap::Parser;

// mimalloc: admission work is dominated by small allocations of JSON values; measured
// faster than the system allocator in the engine benchmark (BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = initium::cli::Cli::parse();
    // Not locked for the whole run: `serve` logs to stderr from many threads.
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    match initium::cli::run(cli.command, &mut out, &mut err) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
