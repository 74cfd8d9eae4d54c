package cli

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/manifest"
)

// Exit codes of `gpufrac validate`.
const (
	exitInvalid    = 1 // some object asks for an invalid fraction
	exitUnreadable = 2 // a file could not be read or is not YAML/JSON objects
)

func newValidateCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "validate FILE|DIR|- ...",
		Short: "Check the GPU-fraction annotations of pod manifests offline",
		Long: `validate reads YAML or JSON manifests (several documents per file, Lists too)
and checks every object that carries a pod template — Pod, Deployment,
StatefulSet, DaemonSet, ReplicaSet, Job, CronJob — with the same rules as the
admission webhook. "-" reads standard input; a directory means its *.yaml,
*.yml and *.json files.

For each object it prints one line:
  OK <kind> <namespace>/<name>: <normalised request>
  INVALID <kind> <namespace>/<name>: <what to fix>
  SKIP <kind> <namespace>/<name>: no pod template (and not a claim)
preceded by a line per warning the admission webhook would return (kubectl
prints those; the object is still admitted):
  WARNING <kind> <namespace>/<name>: <what probably does not mean what it says>

Exit status: 0 when all are valid, 1 when any is invalid, 2 when a file
cannot be read or is not YAML/JSON (the file and line are printed).`,
		Example: `  gpufrac validate examples/
  kubectl get deploy -o yaml | gpufrac validate -`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runValidate(cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr(), args)
		},
	}
}

func runValidate(stdin io.Reader, stdout, errOut io.Writer, args []string) error {
	out := bufio.NewWriter(stdout)
	files, err := expandArgs(args)
	code := 0
	if err != nil {
		fmt.Fprintf(errOut, "error: %v\n", err)
		code = exitUnreadable
	}
	for _, file := range files {
		objs, err := readManifest(stdin, file)
		for _, obj := range objs {
			if c := report(out, obj); c > code {
				code = c
			}
		}
		if err != nil {
			if flushErr := out.Flush(); flushErr != nil { // keep stdout and stderr in order
				return flushErr
			}
			fmt.Fprintf(errOut, "error: %v\n", err)
			code = exitUnreadable
		}
	}
	if err := out.Flush(); err != nil {
		return err
	}
	if code != 0 {
		return &ExitError{Code: code}
	}
	return nil
}

// expandArgs turns directories into their manifest files, sorted.
func expandArgs(args []string) ([]string, error) {
	var files []string
	var errs []error
	for _, arg := range args {
		if arg == "-" {
			files = append(files, arg)
			continue
		}
		info, err := os.Stat(arg)
		if err != nil || !info.IsDir() {
			files = append(files, arg) // read errors are reported per file
			continue
		}
		entries, err := os.ReadDir(arg)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var found []string
		for _, e := range entries {
			switch strings.ToLower(filepath.Ext(e.Name())) {
			case ".yaml", ".yml", ".json":
				if !e.IsDir() {
					found = append(found, filepath.Join(arg, e.Name()))
				}
			}
		}
		if len(found) == 0 {
			errs = append(errs, fmt.Errorf("%s: no *.yaml, *.yml or *.json files", arg))
		}
		slices.Sort(found)
		files = append(files, found...)
	}
	return files, errors.Join(errs...)
}

func readManifest(stdin io.Reader, file string) ([]manifest.Object, error) {
	if file == "-" {
		return manifest.Decode(stdin, "<stdin>")
	}
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	return manifest.Decode(f, file)
}

// report prints one object's verdict and returns its exit code.
func report(out io.Writer, obj manifest.Object) int {
	ns := obj.Namespace
	if ns == "" {
		ns = "default"
	}
	id := fmt.Sprintf("%s %s/%s", obj.Kind, ns, obj.Name)
	if obj.Template == nil && obj.Claim == nil && obj.Err == nil {
		fmt.Fprintf(out, "SKIP %s: no pod template\n", id)
		return 0
	}
	reqs, warnings, err := manifest.Validate(obj)
	for _, w := range warnings {
		fmt.Fprintf(out, "WARNING %s: %s\n", id, w)
	}
	if err != nil {
		fmt.Fprintf(out, "INVALID %s: %v\n", id, err)
		return exitInvalid
	}
	fmt.Fprintf(out, "OK %s: %s\n", id, describeObject(obj, reqs))
	return 0
}

// describeObject says what a valid object asks: its fractions, the
// shares its claim asks of gpufrac's driver, or the claims its pods use.
func describeObject(obj manifest.Object, reqs []api.Request) string {
	switch {
	case obj.Claim != nil:
		var parts []string
		for _, r := range obj.Claim.Devices.Requests {
			if r.Exactly == nil || (r.Exactly.DeviceClassName != api.DRAClassTimeSlicing && r.Exactly.DeviceClassName != api.DRAClassSMSharing) {
				continue
			}
			part := "DRA share " + r.Name + " of " + r.Exactly.DeviceClassName
			if c := r.Exactly.Capacity; c != nil {
				for _, k := range []resourceapi.QualifiedName{api.DRACapacityMemory, api.DRACapacityCompute} {
					if q, ok := c.Requests[k]; ok {
						part += " " + string(k) + "=" + q.String()
					}
				}
			}
			parts = append(parts, part)
		}
		if len(parts) == 0 {
			return "no share of " + api.DRADriver
		}
		return strings.Join(parts, "; ")
	case len(reqs) == 0 && obj.Template != nil && len(obj.Template.Spec.ResourceClaims) > 0:
		var names []string
		for _, c := range obj.Template.Spec.ResourceClaims {
			names = append(names, c.Name)
		}
		return "GPU through DRA claims " + strings.Join(names, ", ")
	}
	return describe(reqs)
}

func describe(reqs []api.Request) string {
	if len(reqs) == 0 {
		return "no GPU fraction"
	}
	parts := make([]string, len(reqs))
	for i, r := range reqs {
		parts[i] = r.String()
	}
	return strings.Join(parts, "; ")
}
