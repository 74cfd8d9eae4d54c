package api

import (
	"flag"
	"fmt"
	"go/ast"
	goparser "go/parser"
	"go/token"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// contractKey is one key, condition or resource of the contract between
// the components, with the one function that writes it and the one that
// reads it.
type contractKey struct {
	name, key string // the constant's name in this package, its value
	// what: annotation, label, condition or resource; object: whose.
	what, object   string
	writer, reader string
	// user: a key a user writes too (the request, which Parse reads and
	// admission resolves), so not held to the codec by the source scan.
	user bool
}

// contract lists every key, condition and resource the components
// exchange. The source scan below holds every other package to these
// codecs, and docs/architecture.md shows this list as its contract table
// (TestArchitectureShowsTheContract).
var contract = []contractKey{
	{name: "SuffixDevices", key: ContainerKeyPrefix + "<c>" + SuffixDevices, what: "annotation", object: "tenant pod", writer: "scheduler: Decision.Write", reader: "node agent, audit, scheduler: ParseAssignments"},
	{name: "SuffixComputePortion", key: ContainerKeyPrefix + "<c>" + SuffixComputePortion, what: "annotation", object: "tenant pod", writer: "scheduler: Decision.Write", reader: "node agent, audit, scheduler: ParseAssignments"},
	{name: "SuffixMemoryRequest", key: ContainerKeyPrefix + "<c>" + SuffixMemoryRequest, what: "annotation", object: "tenant pod", writer: "user, webhook (resolved), scheduler: Decision.Write", reader: "Parse, ParseAssignments", user: true},
	{name: "SuffixMemoryLimit", key: ContainerKeyPrefix + "<c>" + SuffixMemoryLimit, what: "annotation", object: "tenant pod", writer: "user, webhook (resolved), scheduler: Decision.Write", reader: "Parse, ParseAssignments", user: true},
	{name: "SuffixComputeMode", key: ContainerKeyPrefix + "<c>" + SuffixComputeMode, what: "annotation", object: "tenant pod", writer: "user, webhook (resolved), scheduler: Decision.Write", reader: "Parse, ParseAssignments", user: true},
	{name: "GPUGroupsAnnotation", key: GPUGroupsAnnotation, what: "annotation", object: "tenant pod", writer: "scheduler: Decision.Write", reader: "DecisionGroups; webhook (guards it): IsDecisionKey"},
	{name: "ResolvedKeysAnnotation", key: ResolvedKeysAnnotation, what: "annotation", object: "tenant pod", writer: "scheduler: Decision.Write", reader: "Intent; webhook (guards it): IsDecisionKey"},
	{name: "GPUGroupLabel", key: GPUGroupLabel, what: "label", object: "tenant pod, reservation pod", writer: "scheduler: Decision.Write, ReservationLabels", reader: "ReservationOf"},
	{name: "StandingLabel", key: StandingLabel, what: "label", object: "reservation pod", writer: "scheduler: ReservationLabels", reader: "ReservationOf"},
	{name: "ReservedGPUAnnotation", key: ReservedGPUAnnotation, what: "annotation", object: "reservation pod", writer: "node agent: ReservedGPUWrite", reader: "scheduler, audit: ReservationOf"},
	{name: "SharesHeldAnnotation", key: SharesHeldAnnotation, what: "annotation", object: "standing reservation pod", writer: "scheduler: SharesHeld.Write", reader: "node agent (DRA): ReservationOf, ParseSharesHeld"},
	{name: "ResizedFromAnnotation", key: ResizedFromAnnotation, what: "annotation", object: "resized tenant pod", writer: "scheduler: ResizeDecision (ResizeStatusPatch)", reader: "node agent, audit: ResizeOf, Resized"},
	{name: "EnforcedAnnotation", key: EnforcedAnnotation, what: "annotation", object: "resized tenant pod", writer: "node agent: EnforcedWrite (ResizeStatusPatch)", reader: "scheduler, audit: ResizeOf; webhook: IsEnforcedKey"},
	{name: "ConditionResizePending", key: ConditionResizePending, what: "condition", object: "resized tenant pod", writer: "scheduler: ResizeCondition", reader: "PodResizeCondition; node agent's pod cache: IsResizeCondition"},
	{name: "ConditionResizeInProgress", key: ConditionResizeInProgress, what: "condition", object: "resized tenant pod", writer: "scheduler, node agent: ResizeCondition", reader: "PodResizeCondition; node agent's pod cache: IsResizeCondition"},
	{name: "ResourceGPUMemory", key: string(ResourceGPUMemory), what: "resource", object: "tenant pod (quota charge), node", writer: "webhook: PodUsage, ChargeQuantity; node agent: ChargeCapacityList", reader: "quota, scheduler: ChargedMiB, ShareBudgetMiB; webhook: Charges, ChargedMiB (claim guard, terminal phase, MPS clients)"},
	{name: "LabelGPUCount", key: LabelGPUCount, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "InventoryOf"},
	{name: "LabelGPUMemory", key: LabelGPUMemory, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "InventoryOf"},
	{name: "LabelGPUProduct", key: LabelGPUProduct, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "InventoryOf, InventoryLabelled, GPUProduct"},
	{name: "LabelGPUMemoryReserve", key: LabelGPUMemoryReserve, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "InventoryOf"},
	{name: "LabelMemoryEnforcement", key: LabelMemoryEnforcement, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "MemoryEnforcement"},
	{name: "LabelStandingGPUs", key: LabelStandingGPUs, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "StandingGPUs, StandingLabelled"},
	{name: "LabelFractionsClosed", key: LabelFractionsClosed, what: "label", object: "node", writer: "gpufrac mps-replace: drain.Run", reader: "scheduler: Inventory; node agent: publish.Compute"},
	{name: "LabelReservationNamespace", key: LabelReservationNamespace, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "audit, top, dashboard: ReservationNamespace; scheduler: ReservationNamespaceLabelled"},
	{name: "LabelAgentHeartbeat", key: LabelAgentHeartbeat, what: "label", object: "node", writer: "node agent: NodeReport.Labels", reader: "AgentSilent"},
	{name: "UsageAnnotation", key: UsageAnnotation, what: "annotation", object: "node", writer: "node agent: UsageWrite", reader: "top, dashboard, audit (burst reclaim order, through clusterview): UsageOf"},
	{name: "LabelPreemptibility", key: LabelPreemptibility, what: "label", object: "tenant pod", writer: "user", reader: "scheduler (consolidation): OptedInToMoves", user: true},
	{name: "SimulatedLoadAnnotation", key: SimulatedLoadAnnotation, what: "annotation", object: "tenant pod (simulated nodes only)", writer: "user", reader: "node agent (--simulate-gpus): SimulatedLoad", user: true},
	{name: "ConditionFractioningReady", key: ConditionFractioningReady, what: "condition", object: "node", writer: "node agent: publish.Compute", reader: "InventoryOf, FractioningCondition"},
}

// No package but this one reads or writes a contract key by hand: outside
// pkg/api, production code never indexes a map with one, puts one in a
// map literal, or compares a key with one. It calls the codec.
func TestContractKeysHaveOneCodec(t *testing.T) {
	names := map[string]bool{}
	for _, k := range contract {
		names[k.name] = !k.user
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if rel == filepath.Join("pkg", "api") || strings.HasPrefix(d.Name(), ".") || rel == "bin" || rel == "test" {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := goparser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		isKey := func(e ast.Expr) bool {
			sel, ok := e.(*ast.SelectorExpr)
			if !ok {
				return false
			}
			pkg, ok := sel.X.(*ast.Ident)
			return ok && pkg.Name == "api" && names[sel.Sel.Name]
		}
		report := func(n ast.Node, how string) {
			found = append(found, fmt.Sprintf("%s: %s", fset.Position(n.Pos()).String()[len(root)+1:], how))
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.IndexExpr:
				if isKey(n.Index) {
					report(n, "indexes a map with a contract key")
				}
			case *ast.KeyValueExpr:
				if isKey(n.Key) {
					report(n, "writes a contract key in a literal")
				}
			case *ast.BinaryExpr:
				if (n.Op == token.EQL || n.Op == token.NEQ) && (isKey(n.X) || isKey(n.Y)) {
					report(n, "compares with a contract key")
				}
			case *ast.CallExpr:
				// api.ContainerKey(c, api.SuffixDevices) builds a key to
				// read or write a decision by hand.
				if sel, ok := n.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "ContainerKey" && len(n.Args) == 2 && isKey(n.Args[1]) {
					if !inMessage(f, n) {
						report(n, "builds a decision key by hand")
					}
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(found) > 0 {
		t.Errorf("contract keys read or written outside pkg/api's codec (call the codec in contract.go instead):\n%s", strings.Join(found, "\n"))
	}
}

// inMessage says whether a call sits in the arguments of an fmt call: a
// key named in an error message, not read.
func inMessage(f *ast.File, call *ast.CallExpr) bool {
	in := false
	ast.Inspect(f, func(n ast.Node) bool {
		c, ok := n.(*ast.CallExpr)
		if !ok || in {
			return !in
		}
		if sel, ok := c.Fun.(*ast.SelectorExpr); ok {
			if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "fmt" && slices.ContainsFunc(c.Args, func(a ast.Expr) bool {
				return a.Pos() <= call.Pos() && call.End() <= a.End()
			}) {
				in = true
			}
		}
		return true
	})
	return in
}

// Each key's writer and reader agree: what is written reads back the
// same, over random decisions, reservations and node reports.
func TestContractRoundTrips(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	uuid := func() string {
		return fmt.Sprintf("GPU-%08x-%04x-%04x-%04x-%012x", rng.Uint32(), rng.Uint32N(1<<16), rng.Uint32N(1<<16), rng.Uint32N(1<<16), rng.Uint64N(1<<48))
	}
	for i := range 500 {
		// A tenant's decision.
		n := 1 + rng.IntN(3)
		a := Assignment{Container: []string{"main", "c.1", "x"}[rng.IntN(3)], RequestMiB: 1 + rng.Int64N(80000), Mode: TimeSlicing}
		a.LimitMiB = a.RequestMiB + rng.Int64N(1000)
		if rng.IntN(2) == 0 {
			a.Mode, a.Portion = SMSharing, Thousandths(1+rng.Int64N(1000))
		}
		if rng.IntN(3) == 0 {
			a.CDIKind = CDIKindNVIDIAGPU
		}
		var groups []string
		for range n {
			a.Devices = append(a.Devices, uuid())
			groups = append(groups, fmt.Sprintf("g%d", rng.IntN(1000)))
		}
		current := map[string]string{KeyFraction: "0.5", ContainerKey(a.Container, SuffixComputePortion): "0.9"}
		ann, labels := Decision{Assignment: a, Groups: groups}.Write(current)
		written := ann.Apply(current)
		got, err := ParseAssignments(written)
		if err != nil || len(got) != 1 || !slices.Equal(got[0].Devices, a.Devices) || got[0].CDIKind != a.CDIKind ||
			got[0].RequestMiB != a.RequestMiB || got[0].LimitMiB != a.LimitMiB || got[0].Mode != a.Mode || got[0].Portion != a.Portion {
			t.Fatalf("case %d: wrote %+v, read %+v, %v", i, a, got, err)
		}
		if g := DecisionGroups(written); !slices.Equal(g, groups) {
			t.Fatalf("case %d: groups %v read back as %v", i, groups, g)
		}
		if l := labels.Apply(map[string]string{GPUGroupLabel: "stale"}); (n == 1) != (l[GPUGroupLabel] == groups[0]) {
			t.Fatalf("case %d: %d GPUs, group label %q", i, n, l[GPUGroupLabel])
		}
		// Intent takes exactly the decision back off.
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: written}}
		if intent := Intent(pod); HasDecision(intent.Annotations) || len(DecisionGroups(intent.Annotations)) != 0 || intent.Annotations[KeyFraction] != "0.5" {
			t.Fatalf("case %d: intent %v still carries the decision or lost the request", i, intent.Annotations)
		}

		// A reservation pod.
		group, standing, gpu := fmt.Sprintf("g%d", i), rng.IntN(2) == 0, uuid()
		held := SharesHeld{MemoryMiB: rng.Int64N(80000), Mode: SMSharing, Portion: rng.Int64N(1001)}
		r := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Labels: ReservationLabels(group, standing)}}
		r.Annotations = held.Write().Apply(ReservedGPUWrite(gpu).Apply(nil))
		meta, ok := ReservationOf(r)
		if !ok || meta.Group != group || meta.Standing != standing || meta.GPU != gpu || !meta.HeldSet {
			t.Fatalf("case %d: reservation read back as %+v, %v", i, meta, ok)
		}
		if h, err := ParseSharesHeld(meta.Held); err != nil || h != held {
			t.Fatalf("case %d: held %+v read back as %+v, %v", i, held, h, err)
		}

		// A node's report.
		report := NodeReport{Inventory: Inventory{Count: 1 + rng.IntN(8), MemoryMiB: 1024 + rng.Int64N(200000), Model: "NVIDIA-H100"},
			Enforcement: []string{"driver", "mps-pinned", "none"}[rng.IntN(3)], Standing: rng.IntN(3),
			Heartbeat: time.Duration(3+rng.IntN(300)) * time.Second}
		report.ReserveMiB = rng.Int64N(report.Inventory.MemoryMiB)
		report.Inventory.ReserveMiB = report.ReserveMiB
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{}}}
		for k, v := range report.Labels() {
			if v != nil {
				node.Labels[k] = *v
			}
		}
		node.Status.Allocatable = corev1.ResourceList{ResourceGPU: *resource.NewQuantity(int64(report.Inventory.Count), resource.DecimalSI)}
		inv, _, why := InventoryOf(node)
		if inv != report.Inventory || MemoryEnforcement(node) != report.Enforcement || StandingGPUs(node, inv.Count) != min(report.Standing, inv.Count) ||
			StandingLabelled(node) != (report.Standing > 0) || !InventoryLabelled(node.Labels) {
			t.Fatalf("case %d: report %+v read back as %+v (%s), enforcement %q, standing %d", i, report, inv, why, MemoryEnforcement(node), StandingGPUs(node, inv.Count))
		}
		// The heartbeat bound: silent just past it, not at it.
		beat := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
		node.Status.Conditions = []corev1.NodeCondition{{Type: ConditionFractioningReady, Status: corev1.ConditionTrue, LastHeartbeatTime: metav1.NewTime(beat)}}
		if silent, _ := AgentSilent(node, beat.Add(report.Heartbeat)); silent {
			t.Fatalf("case %d: silent at its bound %s", i, report.Heartbeat)
		}
		if silent, why := AgentSilent(node, beat.Add(report.Heartbeat+time.Second)); !silent || !strings.Contains(why, "has not been heard from for") {
			t.Fatalf("case %d: not silent past its bound %s: %q", i, report.Heartbeat, why)
		}
	}
}

// An agent that stops renewing its heartbeat makes its node silent after
// the bound it published (DefaultAgentHeartbeat without one); a node that
// never reported the condition is InventoryOf's to refuse, not this.
func TestAgentSilent(t *testing.T) {
	beat := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	node := func(labels map[string]string, conds ...corev1.NodeCondition) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Status: corev1.NodeStatus{Conditions: conds}}
	}
	ready := corev1.NodeCondition{Type: ConditionFractioningReady, Status: corev1.ConditionTrue, LastHeartbeatTime: metav1.NewTime(beat)}
	for _, tt := range []struct {
		name   string
		node   *corev1.Node
		after  time.Duration
		silent bool
	}{
		{"fresh", node(nil, ready), 10 * time.Second, false},
		{"the default bound", node(nil, ready), DefaultAgentHeartbeat + time.Second, true},
		{"its own bound", node(map[string]string{LabelAgentHeartbeat: "30"}, ready), 31 * time.Second, true},
		{"a longer bound", node(map[string]string{LabelAgentHeartbeat: "300"}, ready), 120 * time.Second, false},
		{"an unreadable bound: the default", node(map[string]string{LabelAgentHeartbeat: "soon"}, ready), 60 * time.Second, false},
		{"no condition", node(nil), time.Hour, false},
	} {
		silent, why := AgentSilent(tt.node, beat.Add(tt.after))
		if silent != tt.silent || (silent && !strings.Contains(why, "gpufrac agent has not been heard from for")) {
			t.Errorf("%s: silent %v (%q), want %v", tt.name, silent, why, tt.silent)
		}
	}
}

// contractTable is the contract as docs/architecture.md shows it.
func contractTable() string {
	var b strings.Builder
	b.WriteString("| object | key | written by | read by |\n|---|---|---|---|\n")
	for _, k := range contract {
		fmt.Fprintf(&b, "| %s | %s `%s` | %s | %s |\n", k.object, k.what, k.key, k.writer, k.reader)
	}
	return b.String()
}

var updateDocs = flag.Bool("update", false, "write the contract table into docs/architecture.md")

// The architecture page's contract table is the contract list: generated
// from it (go test ./pkg/api -run TestArchitectureShowsTheContract
// -update), and held to it here.
func TestArchitectureShowsTheContract(t *testing.T) {
	const begin, end = "<!-- contract: generated from pkg/api/contract_test.go -->\n", "<!-- end of contract -->"
	path := filepath.Join("..", "..", "docs", "architecture.md")
	doc, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	head, rest, ok := strings.Cut(string(doc), begin)
	_, tail, ok2 := strings.Cut(rest, end)
	if !ok || !ok2 {
		t.Fatalf("%s has no %q ... %q section", path, strings.TrimSpace(begin), end)
	}
	want := head + begin + contractTable() + end + tail
	if *updateDocs {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if want != string(doc) {
		t.Errorf("%s's contract table is not pkg/api's contract list; run go test ./pkg/api -run TestArchitectureShowsTheContract -update. It should read:\n%s", path, contractTable())
	}
}

// notExchanged are the keys of this package that name no contract between
// the components, and why.
var notExchanged = map[string]string{
	"ResourceGPU":              "nvidia.com/gpu, the device plugin's resource, which reservation pods and whole-GPU pods ask for",
	"SuffixMemoryPortionLimit": "a KAI request key, read by Parse only",
}

// Every annotation, label, condition and resource this package names is
// in the contract list, or said not to be exchanged.
func TestContractListsEveryKey(t *testing.T) {
	listed := map[string]bool{}
	for _, k := range contract {
		listed[k.name] = true
	}
	fset := token.NewFileSet()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := goparser.ParseFile(fset, e.Name(), nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	var missing []string
	for _, f := range files {
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.CONST {
				continue
			}
			for _, spec := range g.Specs {
				for _, n := range spec.(*ast.ValueSpec).Names {
					name := n.Name
					key := strings.HasPrefix(name, "Label") || strings.HasPrefix(name, "Condition") || strings.HasPrefix(name, "Resource") ||
						strings.HasPrefix(name, "Suffix") || strings.HasSuffix(name, "Annotation")
					if _, exempt := notExchanged[name]; key && n.IsExported() && !listed[name] && !exempt {
						missing = append(missing, fset.Position(n.Pos()).String()+": "+name)
					}
				}
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("keys of pkg/api in no contract row (add them to contract, or to notExchanged with why):\n%s", strings.Join(missing, "\n"))
	}
}
