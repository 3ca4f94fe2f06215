// ops-check: what Flux, Argo CD and Prometheus make of initium's objects and queries, for
// initium's tests (tests/gitops.rs, tests/monitoring.rs). Built by scripts/ops-check.
//
//	ops-check health LUA_FILE < OBJECT    the object (JSON or YAML) as kstatus reads it (Flux's
//	                                      health checks) and as Argo CD reads it with the Lua
//	                                      health script LUA_FILE; prints one JSON object
//	ops-check promql < EXPRESSIONS        a JSON array of PromQL expressions: prints, per
//	                                      expression, the parse error or the metric names it selects
//	ops-check rules < GROUPS              a Prometheus rule file (`groups:`, JSON or YAML, e.g. a
//	                                      PrometheusRule's spec) validated as Prometheus loads it;
//	                                      prints the errors as a JSON array
//
// Exit status 0 when the input could be read (the verdicts are in the output), 1 otherwise.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	if err := run(os.Args[1:], os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "ops-check: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string, stdin io.Reader, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New("usage: ops-check health LUA_FILE | promql | rules (input on stdin)")
	}
	input, err := io.ReadAll(stdin)
	if err != nil {
		return fmt.Errorf("cannot read stdin: %w", err)
	}
	var out any
	switch {
	case args[0] == "health" && len(args) == 2:
		out, err = health(input, args[1])
	case args[0] == "promql" && len(args) == 1:
		out, err = promql(input)
	case args[0] == "rules" && len(args) == 1:
		out, err = rules(input)
	default:
		return fmt.Errorf("unknown command %q: use health LUA_FILE, promql or rules", args)
	}
	if err != nil {
		return err
	}
	return json.NewEncoder(stdout).Encode(out)
}

// Verdict is a tool's reading of an object's health.
type Verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

type healthReport struct {
	Kstatus Verdict `json:"kstatus"`
	ArgoCD  Verdict `json:"argocd"`
}

func health(input []byte, luaFile string) (*healthReport, error) {
	object, err := yaml.ToJSON(input)
	if err != nil {
		return nil, fmt.Errorf("the object is neither JSON nor YAML: %w", err)
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(object); err != nil {
		return nil, fmt.Errorf("the object is not a Kubernetes object: %w", err)
	}
	computed, err := status.Compute(u)
	if err != nil {
		return nil, fmt.Errorf("kstatus cannot compute the status: %w", err)
	}
	script, err := os.ReadFile(luaFile)
	if err != nil {
		return nil, fmt.Errorf("cannot read the health script: %w", err)
	}
	argo, err := argoHealth(u, string(script))
	if err != nil {
		return nil, err
	}
	return &healthReport{
		Kstatus: Verdict{Status: computed.Status.String(), Message: computed.Message},
		ArgoCD:  *argo,
	}, nil
}

// The health statuses Argo CD knows; a script that returns another reads as Unknown.
var argoStatuses = map[string]bool{
	"Healthy": true, "Progressing": true, "Degraded": true, "Suspended": true, "Missing": true, "Unknown": true,
}

// argoHealth runs a health script as Argo CD's util/lua does: a state without the standard
// libraries but base, package and table (a script needs `resource.customizations.useOpenLibs`
// for string or math), a one-second deadline, the object as the global `obj` (numbers as Lua
// numbers), and the table the script returns read for `status` and `message`.
func argoHealth(u *unstructured.Unstructured, script string) (*Verdict, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
	} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return nil, fmt.Errorf("cannot open the Lua library %s: %w", lib.name, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", decode(l, u.Object))
	if err := l.DoString(script); err != nil {
		return nil, fmt.Errorf("the health script failed: %w", err)
	}
	returned, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return nil, fmt.Errorf("the health script returned a %s, not a table", l.Get(-1).Type())
	}
	verdict := &Verdict{
		Status:  lua.LVAsString(returned.RawGetString("status")),
		Message: lua.LVAsString(returned.RawGetString("message")),
	}
	if !argoStatuses[verdict.Status] {
		return &Verdict{Status: "Unknown", Message: fmt.Sprintf("the script returned the status %q, which Argo CD does not know", verdict.Status)}, nil
	}
	return verdict, nil
}

// decode is Argo CD's decodeValue: JSON values as Lua values.
func decode(l *lua.LState, value any) lua.LValue {
	switch v := value.(type) {
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case bool:
		return lua.LBool(v)
	case []any:
		list := l.CreateTable(len(v), 0)
		for _, item := range v {
			list.Append(decode(l, item))
		}
		return list
	case map[string]any:
		table := l.CreateTable(0, len(v))
		for key, item := range v {
			table.RawSetH(lua.LString(key), decode(l, item))
		}
		return table
	}
	return lua.LNil
}

type parsed struct {
	Expr    string   `json:"expr"`
	Error   string   `json:"error,omitempty"`
	Metrics []string `json:"metrics"`
}

func promql(input []byte) ([]parsed, error) {
	var exprs []string
	if err := json.Unmarshal(input, &exprs); err != nil {
		return nil, fmt.Errorf("stdin is not a JSON array of strings: %w", err)
	}
	p := parser.NewParser(parser.Options{})
	out := make([]parsed, 0, len(exprs))
	for _, text := range exprs {
		result := parsed{Expr: text, Metrics: []string{}}
		expr, err := p.ParseExpr(text)
		if err != nil {
			result.Error = err.Error()
		} else {
			seen := map[string]bool{}
			parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
				if selector, ok := node.(*parser.VectorSelector); ok && !seen[selector.Name] {
					seen[selector.Name] = true
					result.Metrics = append(result.Metrics, selector.Name)
				}
				return nil
			})
		}
		out = append(out, result)
	}
	return out, nil
}

func rules(input []byte) ([]string, error) {
	text, err := yaml.ToJSON(input)
	if err != nil {
		return nil, fmt.Errorf("the rule file is neither JSON nor YAML: %w", err)
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	_, errs := rulefmt.Parse(text, false, model.UTF8Validation, parser.NewParser(parser.Options{}), logger)
	out := make([]string, 0, len(errs))
	for _, err := range errs {
		out = append(out, err.Error())
	}
	return out, nil
}
