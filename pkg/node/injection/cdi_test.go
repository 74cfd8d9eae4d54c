package injection

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

// A claim's share is enforced exactly as an annotated container's with the
// same share: the same environment, mounts and hook, on every backend and
// MPS interface the DRA path supports.
func TestShareEditsMatchTheNRIInjection(t *testing.T) {
	const uuid = "GPU-4f1e2d3c-0000-1111-2222-333344445555"
	ts := api.Assignment{Container: "main", Devices: []string{uuid}, RequestMiB: 20480, LimitMiB: 30720, Mode: api.TimeSlicing}
	sm := api.Assignment{Container: "main", Devices: []string{uuid}, RequestMiB: 20480, LimitMiB: 20480, Mode: api.SMSharing, Portion: fraction(t, "0.25")}
	pinned := cfg
	pinned.Backend, pinned.HookPath = nodeapi.BackendMPSPinned, ""
	legacy := pinned
	legacy.MPS = nodeapi.MPSv2
	noShim := cfg
	noShim.ShimDir = ""
	for name, tc := range map[string]struct {
		a   api.Assignment
		cfg Config
	}{
		"time-slicing, driver limits": {ts, cfg},
		"sm-sharing, driver limits":   {sm, cfg},
		"time-slicing, MPS pinned":    {ts, pinned},
		"time-slicing, MPS v2":        {ts, legacy},
		"no nvidia-smi view":          {ts, noShim},
	} {
		t.Run(name, func(t *testing.T) {
			pod := Pod{UID: "0d9c8b7a-6543-2100-aaaa-bbbbccccdddd", Annotations: tc.a.Annotations()}
			env := []string{nodeapi.EnvLibraryPath + "=" + ImageLibraryPath, "PATH=/usr/bin"}
			d := Decide(pod, "main", env, tc.cfg)
			if d.Verdict != Run {
				t.Fatalf("the NRI path refuses the share: %v", d.Reason)
			}
			namespace := ""
			if tc.a.Mode == api.SMSharing {
				namespace = nodeapi.NamespaceName(pod.UID, "main")
			}
			edits, err := ShareEdits(tc.a, namespace, tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(OutcomeOfNRI(env, d.Adjustment), OutcomeOfCDI(env, edits)); diff != "" {
				t.Errorf("NRI (-) and CDI (+) differ:\n%s", diff)
			}
		})
	}
}

// A share the node cannot enforce is an error, never edits without limits.
func TestShareEditsRefuseWhatTheNodeCannotEnforce(t *testing.T) {
	const uuid = "GPU-4f1e2d3c-0000-1111-2222-333344445555"
	ts := api.Assignment{Container: "claim/gpu", Devices: []string{uuid}, RequestMiB: 1024, LimitMiB: 1024, Mode: api.TimeSlicing}
	sm := ts
	sm.Mode, sm.Portion = api.SMSharing, fraction(t, "0.5")
	toolkit, off, noMPS, legacy := cfg, cfg, cfg, cfg
	toolkit.Backend, off.Backend, noMPS.MPS, legacy.MPS = nodeapi.BackendToolkit, nodeapi.BackendOff, nodeapi.MPSNone, nodeapi.MPSv2
	bad := ts
	bad.LimitMiB = 512
	noPortion := sm
	noPortion.Portion = api.Fraction{}
	for name, tc := range map[string]struct {
		a         api.Assignment
		namespace string
		cfg       Config
		want      string
	}{
		"toolkit backend":         {ts, "", toolkit, "toolkit memory-limit backend"},
		"limits off":              {ts, "", off, "enforces no GPU memory limits"},
		"no MPS daemon":           {ts, "", noMPS, "MPS control daemon is not running"},
		"sm-sharing on MPS v2":    {sm, "ns", legacy, "needs MPS v3"},
		"sm-sharing, no portion":  {noPortion, "ns", cfg, "without a compute portion"},
		"limit below the request": {bad, "", cfg, "the limit at least the request"},
	} {
		t.Run(name, func(t *testing.T) {
			edits, err := ShareEdits(tc.a, tc.namespace, tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got edits %+v, error %v; want an error saying %q", edits, err, tc.want)
			}
		})
	}
}

func fraction(t *testing.T, s string) api.Fraction {
	t.Helper()
	f, err := api.ParseFraction(s)
	if err != nil {
		t.Fatal(err)
	}
	return f
}
