// Package compat runs the KAI compatibility corpus: pods shaped as KAI
// Scheduler's admission sees them, annotations as KAI's binder leaves
// them, and scheduled pods as NVIDIA's node operator would be handed them,
// each with the behaviour it pins. The admission and node cases go
// through the gpufrac command line itself (validate, explain), as a user
// runs it; a case where gpufrac deliberately differs from KAI must name
// the difference, and docs/compatibility.md must list it.
package compat

import (
	"bytes"
	"errors"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/internal/cli"
	"github.com/gpufrac/gpufrac/pkg/api"
)

// admissionCase is one pod and KAI's admission verdict on it.
type admissionCase struct {
	Name string `json:"name"`
	// Pins is the behaviour the case holds gpufrac to, with its source.
	Pins string `json:"pins"`
	// KAI is KAI's verdict: admit or refuse.
	KAI string `json:"kai"`
	// Difference names the docs/compatibility.md row when gpufrac's
	// verdict is the other one.
	Difference string `json:"difference"`
	// Want is a substring of gpufrac's output line (OK, WARNING or INVALID).
	Want []string `json:"want"`
	Pod  any      `json:"pod"`
}

type binderCase struct {
	Name        string            `json:"name"`
	Pins        string            `json:"pins"`
	Annotations map[string]string `json:"annotations"`
	// Want is the assignment read back; nil with Error for a refusal.
	Want  *api.Assignment `json:"want"`
	Error string          `json:"error"`
	// Portion is Want's compute portion as a decimal ("" for none).
	Portion string `json:"portion"`
}

type nodeCase struct {
	Name       string   `json:"name"`
	Pins       string   `json:"pins"`
	Flags      []string `json:"flags"`
	Difference string   `json:"difference"`
	// Exit is gpufrac explain's exit status.
	Exit int `json:"exit"`
	// Want are lines (or parts of lines) of the output, in order.
	Want []string `json:"want"`
	// Absent must not appear in the output.
	Absent []string `json:"absent"`
	Pod    any      `json:"pod"`
}

func load[T any](t *testing.T, file string) []T {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var cases []T
	if err := yaml.UnmarshalStrict(raw, &cases); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if len(cases) == 0 {
		t.Fatalf("%s holds no cases", file)
	}
	return cases
}

// run runs the gpufrac command line with the manifest on standard input.
func run(t *testing.T, manifest any, args ...string) (string, int) {
	t.Helper()
	in, err := yaml.Marshal(manifest)
	if err != nil {
		t.Fatal(err)
	}
	cmd := cli.NewRootCommand()
	var out bytes.Buffer
	cmd.SetIn(bytes.NewReader(in))
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append(args, "-"))
	code := 0
	if err := cmd.Execute(); err != nil {
		var exit *cli.ExitError
		if !errors.As(err, &exit) {
			t.Fatalf("gpufrac %v: %v", args, err)
		}
		code = exit.Code
		if exit.Err != nil {
			out.WriteString(exit.Err.Error() + "\n")
		}
	}
	return out.String(), code
}

// differences are the row ids of docs/compatibility.md.
func differences(t *testing.T) []string {
	t.Helper()
	doc, err := os.ReadFile("../../docs/compatibility.md")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range regexp.MustCompile(`(?m)^\| \*\*([A-Z][0-9]+)\*\* \|`).FindAllStringSubmatch(string(doc), -1) {
		ids = append(ids, m[1])
	}
	if len(ids) == 0 {
		t.Fatal("docs/compatibility.md lists no differences (rows start | **A1** |)")
	}
	return ids
}

func checkCase(t *testing.T, name, pins, difference string, ids []string) {
	t.Helper()
	if strings.TrimSpace(pins) == "" {
		t.Errorf("%s: says no behaviour it pins", name)
	}
	if difference != "" && !slices.Contains(ids, difference) {
		t.Errorf("%s: difference %s is not in docs/compatibility.md (%v)", name, difference, ids)
	}
}

func TestAdmissionVerdictsMatchKAI(t *testing.T) {
	ids := differences(t)
	for _, c := range load[admissionCase](t, "kai/admission.yaml") {
		t.Run(c.Name, func(t *testing.T) {
			checkCase(t, c.Name, c.Pins, c.Difference, ids)
			if c.KAI != "admit" && c.KAI != "refuse" {
				t.Fatalf("kai: %q, want admit or refuse", c.KAI)
			}
			want := c.KAI
			if c.Difference != "" {
				want = map[string]string{"admit": "refuse", "refuse": "admit"}[c.KAI]
			}
			out, code := run(t, c.Pod, "validate")
			got := map[int]string{0: "admit", 1: "refuse"}[code]
			if got != want {
				t.Fatalf("gpufrac validate: %s (exit %d), want %s (KAI: %s)\n%s", got, code, want, c.KAI, out)
			}
			for _, w := range c.Want {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			if want == "admit" && !slices.ContainsFunc(c.Want, func(w string) bool { return strings.HasPrefix(w, "WARNING") }) && strings.Contains(out, "WARNING") {
				t.Errorf("unexpected warning:\n%s", out)
			}
		})
	}
}

func TestBinderOutputIsReadAsKAIMeantIt(t *testing.T) {
	for _, c := range load[binderCase](t, "kai/binder.yaml") {
		t.Run(c.Name, func(t *testing.T) {
			checkCase(t, c.Name, c.Pins, "", nil)
			got, err := api.ParseAssignments(c.Annotations)
			if c.Want == nil {
				if err == nil || !strings.Contains(err.Error(), c.Error) {
					t.Fatalf("error %v, want one containing %q (read %+v)", err, c.Error, got)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused: %v", err)
			}
			want := *c.Want
			if c.Portion != "" {
				p, perr := api.ParseFraction(c.Portion)
				if perr != nil {
					t.Fatal(perr)
				}
				want.Portion = p
			}
			if len(got) != 1 || got[0].Container != want.Container || !slices.Equal(got[0].Devices, want.Devices) ||
				got[0].CDIKind != want.CDIKind || got[0].RequestMiB != want.RequestMiB || got[0].LimitMiB != want.LimitMiB ||
				got[0].Mode != want.Mode || got[0].Portion.Cmp(want.Portion) != 0 {
				t.Errorf("read %+v, want %+v", got, want)
			}
		})
	}
}

func TestNodeSideRunsWhatKAIPlaced(t *testing.T) {
	ids := differences(t)
	for _, c := range load[nodeCase](t, "kai/node.yaml") {
		t.Run(c.Name, func(t *testing.T) {
			checkCase(t, c.Name, c.Pins, c.Difference, ids)
			out, code := run(t, c.Pod, append([]string{"explain"}, c.Flags...)...)
			if code != c.Exit {
				t.Errorf("gpufrac explain exit %d, want %d", code, c.Exit)
			}
			rest := out
			for _, w := range c.Want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Errorf("output lacks %q (in order):\n%s", w, out)
					break
				}
				rest = rest[i+len(w):]
			}
			for _, a := range c.Absent {
				if strings.Contains(out, a) {
					t.Errorf("output has %q:\n%s", a, out)
				}
			}
		})
	}
}
