use std::process::ExitCode;

use clap::Parser;

// mimalloc: admission work is dominated by small allocations of JSON values; measured
// faster than the system allocator in the engine benchmark (BENCHMARKS.md). Without the
// `mimalloc` feature the system allocator is used (for heap profilers). mimalloc reads its
// options from the environment before `main`: deploy/ sets MIMALLOC_ARENA_EAGER_COMMIT=0,
// which saves about 12 MiB of resident memory (docs/operations.md).
#[cfg(feature = "mimalloc")]
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
            // Errors can quote what a client or a rule wrote: control characters are escaped
            // (line breaks kept), so they cannot drive the terminal.
            let text = initium::report(&e);
            let lines: Vec<String> = text
                .lines()
                .map(|line| initium::untrusted::escape(line).into_owned())
                .collect();
            eprintln!("error: {}", lines.join("\n"));
            ExitCode::FAILURE
        }
    }
}
