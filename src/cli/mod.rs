//! The command line: arguments and dispatch. `apply`, `check`, `test` and `crd` are the
//! offline commands (the engine with no cluster: [`input`], [`offline`], [`output`],
//! [`test`]); `serve` hands over to the online composition root.

mod diff;
pub mod explain;
pub mod input;
pub mod offline;
pub mod output;
pub mod test;

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};

use crate::{Error, Result};
use initium_engine::api::Operation;

use offline::{Admitted, admit, describe_object, load_rules, lookup_store, namespace_labels};

#[derive(Parser, Debug)]
#[command(
    name = "initium",
    version,
    about = "A declarative initializer for Kubernetes"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Apply rules to objects offline and print the results.
    Apply(ApplyArgs),
    /// Compile rules and list every error.
    Check(CheckArgs),
    /// Run declarative test cases (see docs/testing.md).
    Test(TestArgs),
    /// Say, per object and rule, what the rule did or which field ruled the object out
    /// (offline, or --cluster with the cluster's rules).
    Explain(explain::ExplainArgs),
    /// Print the CustomResourceDefinitions (or write them to a directory).
    Crd(CrdArgs),
    /// Run the admission webhook, the rule watches and the operations endpoints.
    Serve(Box<crate::serve::ServeArgs>),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OutputFormat {
    Yaml,
    Json,
    Patch,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OperationArg {
    #[value(name = "CREATE", alias = "create")]
    Create,
    #[value(name = "UPDATE", alias = "update")]
    Update,
}

impl From<OperationArg> for Operation {
    fn from(op: OperationArg) -> Operation {
        match op {
            OperationArg::Create => Operation::Create,
            OperationArg::Update => Operation::Update,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct ApplyArgs {
    /// Rule files or directories (`-` for stdin).
    #[arg(short = 'r', long = "rules", required = true, num_args = 1..)]
    pub rules: Vec<PathBuf>,
    /// Object files or directories (`-` for stdin).
    #[arg(short = 'f', long = "filename", required = true, num_args = 1..)]
    pub objects: Vec<PathBuf>,
    /// Output: multi-document YAML, a JSON List, or one JSON patch line per object.
    #[arg(short = 'o', long = "output", value_enum, default_value = "yaml")]
    pub output: OutputFormat,
    /// The admission operation to simulate.
    #[arg(long, value_enum, default_value = "CREATE")]
    pub operation: OperationArg,
    /// Namespace for namespaced objects and MutationRules that do not name one.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
}

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// Rule files or directories (`-` for stdin).
    #[arg(short = 'r', long = "rules", required = true, num_args = 1..)]
    pub rules: Vec<PathBuf>,
    /// Namespace for MutationRules that do not name one.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// Also say how each rule would be served: by the API server (and print the
    /// MutatingAdmissionPolicy and binding initium generates for it, as YAML that
    /// `kubectl apply -f -` takes) or by the webhook (and why). Offline, kinds resolve from
    /// a table of common built-in kinds; in the cluster, from discovery.
    #[arg(long)]
    pub compile: bool,
    /// With --compile: the installation's name (`initium serve --webhook-name`), which
    /// prefixes the generated objects' names.
    #[arg(long, default_value = "initium", requires = "compile")]
    pub owner: String,
    /// With --compile: namespaces the policies leave out (initium's own and
    /// `initium serve --exclude-namespace`).
    #[arg(long = "exclude-namespace", default_values = ["initium-system", "kube-system"], requires = "compile")]
    pub excluded_namespaces: Vec<String>,
    /// With --compile: at most this many rules compiled, the first in initium's order
    /// (`initium serve --max-compiled-rules`).
    #[arg(long, default_value_t = initium_engine::policy::DEFAULT_MAX_COMPILED, requires = "compile")]
    pub max_compiled_rules: usize,
}

#[derive(clap::Args, Debug)]
pub struct TestArgs {
    /// Test files (`*initium-test.yaml`) or directories to search for them.
    #[arg(required = true, num_args = 1..)]
    pub paths: Vec<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct CrdArgs {
    /// Write one file per CRD into this directory instead of printing.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

/// Runs a command, writing results to `out` and the report to `err`.
pub fn run(command: Command, out: &mut dyn Write, err: &mut dyn Write) -> Result<()> {
    match command {
        Command::Apply(args) => apply(args, out, err),
        Command::Check(args) => check(args, out),
        Command::Test(args) => test::run(&args.paths, out),
        Command::Explain(args) => explain::run(args, out, err),
        Command::Crd(args) => crd(args, out),
        Command::Serve(args) => crate::serve::run(*args),
    }
}

fn apply(args: ApplyArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<()> {
    let rules = load_rules(&args.rules, &args.namespace)?;
    if rules.ignored_documents > 0 {
        report(
            err,
            &format!(
                "note: {} non-rule document(s) in the rule inputs were ignored",
                rules.ignored_documents
            ),
        )?;
    }
    let docs = input::read_documents(&args.objects)?;
    let namespaces = namespace_labels(&docs);
    let lookups = lookup_store(&rules.index, &docs, &args.namespace);
    let mut results = Vec::with_capacity(docs.len());
    let mut denials = Vec::new();
    for doc in &docs {
        match admit(
            &rules.index,
            doc,
            args.operation.into(),
            &args.namespace,
            &namespaces,
            &lookups,
        )? {
            Admitted::Ok(outcome) => {
                let what = describe_object(&doc.value);
                if !outcome.applied.is_empty() {
                    let applied: Vec<String> =
                        outcome.applied.iter().map(|r| r.to_string()).collect();
                    report(err, &format!("{what}: mutated by {}", applied.join(", ")))?;
                }
                for w in &outcome.warnings {
                    report(err, &format!("{what}: warning: {w}"))?;
                }
                // What `mode: Audit` rules would have done; none of it is in the output.
                for audited in &outcome.audited {
                    report(err, &format!("{what}: {}", audited.summary()))?;
                }
                results.push(outcome);
            }
            Admitted::Denied(denial) => {
                denials.push(format!("{}: denied: {denial}", describe_object(&doc.value)))
            }
        }
    }
    if !denials.is_empty() {
        return Err(Error::Denied(denials.join("\n")));
    }
    let text = match args.output {
        OutputFormat::Yaml => output::yaml_documents(results.iter().map(|o| &o.object))?,
        OutputFormat::Json => {
            let items: Vec<&Value> = results.iter().map(|o| &o.object).collect();
            output::json_pretty(&json!({"apiVersion": "v1", "kind": "List", "items": items}))?
        }
        OutputFormat::Patch => {
            let mut text = String::new();
            for (doc, outcome) in docs.iter().zip(&results) {
                let line = json!({
                    "object": describe_object(&doc.value),
                    "patch": outcome.patch(),
                });
                text.push_str(
                    &serde_json::to_string(&line)
                        .map_err(|e| Error::output("a patch as JSON", e))?,
                );
                text.push('\n');
            }
            text
        }
    };
    out.write_all(text.as_bytes())
        .map_err(|e| Error::output("the results", e))
}

fn check(args: CheckArgs, out: &mut dyn Write) -> Result<()> {
    let rules = load_rules(&args.rules, &args.namespace)?;
    let mut text = String::new();
    for rule in rules.index.rules() {
        text.push_str(&format!(
            "ok: {}\n",
            initium_engine::untrusted::escape(&rule.id.describe())
        ));
    }
    text.push_str(&format!("{} rule(s) valid\n", rules.index.len()));
    if args.compile {
        text = compiled_text(&rules, &args)?;
    }
    out.write_all(text.as_bytes())
        .map_err(|e| Error::output("the results", e))
}

/// `check --compile`: per rule, how it would be served (YAML comments), then the generated
/// objects as YAML documents.
fn compiled_text(rules: &offline::LoadedRules, args: &CheckArgs) -> Result<String> {
    use initium_engine::policy::{BuiltinResources, PolicySettings, Serving, plan};
    let settings = PolicySettings {
        owner: args.owner.clone(),
        excluded_namespaces: args.excluded_namespaces.clone(),
        max_compiled: args.max_compiled_rules,
    };
    let specs: Vec<(initium_engine::RuleId, &initium_engine::api::RuleSpec)> = rules
        .sources
        .iter()
        .map(|s| (s.id.clone(), &s.spec))
        .collect();
    let served = plan(&specs, &BuiltinResources, &settings);
    let mut text = String::new();
    let mut objects = Vec::new();
    let mut compiled = 0;
    for ((id, _), serving) in specs.iter().zip(&served) {
        let rule = initium_engine::untrusted::escape(&id.describe()).into_owned();
        match serving {
            Serving::ApiServer(generated) => {
                compiled += 1;
                text.push_str(&format!(
                    "# {rule}: served by the API server (MutatingAdmissionPolicy {})\n",
                    generated.name
                ));
                objects.push(&generated.policy);
                objects.push(&generated.binding);
            }
            Serving::Webhook(reason) => {
                let reason = initium_engine::untrusted::escape(&reason.to_string()).into_owned();
                text.push_str(&format!("# {rule}: served by the webhook: {reason}\n"));
            }
        }
    }
    text.push_str(&format!(
        "# {compiled} of {} rule(s) compile to MutatingAdmissionPolicies\n",
        specs.len()
    ));
    text.push_str(&output::yaml_documents(objects.into_iter())?);
    Ok(text)
}

fn crd(args: CrdArgs, out: &mut dyn Write) -> Result<()> {
    match args.out_dir {
        None => out
            .write_all(output::crds_yaml()?.as_bytes())
            .map_err(|e| Error::output("the CustomResourceDefinitions", e)),
        Some(dir) => {
            for (file, text) in output::crd_files()? {
                let path = dir.join(file);
                std::fs::write(&path, text)
                    .map_err(|e| Error::output(path.display().to_string(), e))?;
            }
            Ok(())
        }
    }
}

/// A line on stderr; names and messages in it come from files, so it is escaped first.
pub(crate) fn report(err: &mut dyn Write, line: &str) -> Result<()> {
    writeln!(err, "{}", initium_engine::untrusted::escape(line))
        .map_err(|e| Error::output("to stderr", e))
}
