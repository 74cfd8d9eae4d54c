package scheduler

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// The example configuration and the one the Deployment mounts are the
// same, and the plugin accepts their arguments.
func TestDeployedConfigIsTheExample(t *testing.T) {
	example, err := os.ReadFile("../../deploy/scheduler/config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := os.ReadFile("../../deploy/scheduler/scheduler.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var mounted string
	docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(manifest)))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		var cm struct {
			Kind string            `json:"kind"`
			Data map[string]string `json:"data"`
		}
		if err := yaml.Unmarshal(doc, &cm); err != nil {
			t.Fatal(err)
		}
		if cm.Kind == "ConfigMap" {
			mounted = cm.Data["config.yaml"]
		}
	}
	var a, b map[string]any
	if err := yaml.Unmarshal(example, &a); err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal([]byte(mounted), &b); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(a, b); diff != "" {
		t.Fatalf("deploy/scheduler/config.yaml and the ConfigMap in scheduler.yaml differ (-example +mounted):\n%s", diff)
	}
	var cfg struct {
		LeaderElection struct {
			ResourceNamespace string `json:"resourceNamespace"`
			ResourceName      string `json:"resourceName"`
		} `json:"leaderElection"`
		Profiles []struct {
			SchedulerName string `json:"schedulerName"`
			PluginConfig  []struct {
				Name string         `json:"name"`
				Args map[string]any `json:"args"`
			} `json:"pluginConfig"`
		} `json:"profiles"`
	}
	if err := yaml.Unmarshal(example, &cfg); err != nil {
		t.Fatal(err)
	}
	if len(cfg.Profiles) != 1 || cfg.Profiles[0].SchedulerName != "gpufrac" || len(cfg.Profiles[0].PluginConfig) != 2 ||
		cfg.Profiles[0].PluginConfig[0].Name != "NodeResourcesFit" || cfg.Profiles[0].PluginConfig[1].Name != Name {
		t.Fatalf("example profile: %+v", cfg.Profiles)
	}
	// The quota charge is no node's resource: NodeResourcesFit must not
	// count it, or no share would fit anywhere. Nor GPUs, which this
	// plugin counts with what a preemption frees (preempt.go).
	want := fmt.Sprint([]string{string(api.ResourceGPUMemory), string(api.ResourceGPU)})
	if ignored := fmt.Sprint(cfg.Profiles[0].PluginConfig[0].Args["ignoredResources"]); ignored != want {
		t.Errorf("NodeResourcesFit ignores %s, want %s", ignored, want)
	}
	raw, err := yaml.Marshal(cfg.Profiles[0].PluginConfig[1].Args)
	if err != nil {
		t.Fatal(err)
	}
	args, err := DecodeArgs(&runtime.Unknown{Raw: raw, ContentType: runtime.ContentTypeYAML})
	if err != nil {
		t.Fatal(err)
	}
	var defaults Args
	defaults.Default()
	// The one argument with no default: the example's own leader election.
	if args.LeaderLease != cfg.LeaderElection.ResourceNamespace+"/"+cfg.LeaderElection.ResourceName {
		t.Errorf("leaderLease %q is not the example's leader-election Lease %s/%s", args.LeaderLease, cfg.LeaderElection.ResourceNamespace, cfg.LeaderElection.ResourceName)
	}
	defaults.LeaderLease = args.LeaderLease
	if diff := cmp.Diff(defaults, args); diff != "" {
		t.Errorf("the example's arguments are not the defaults it documents (-defaults +example):\n%s", diff)
	}
}
