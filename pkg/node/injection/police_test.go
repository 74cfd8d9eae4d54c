package injection

import (
	"slices"
	"strings"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
)

// A container outside any gpufrac share sees exactly what it was granted:
// an image's "all" or a tenant's own list becomes the grant, or void.
func TestPolice(t *testing.T) {
	devMount := func(dest string) *nriapi.Mount {
		return &nriapi.Mount{Source: "/dev/null", Destination: dest, Type: "bind"}
	}
	tests := []struct {
		name        string
		env         []string
		mounts      []*nriapi.Mount
		granted     []string
		want        string // NVIDIA_VISIBLE_DEVICES afterwards; "-" unset
		wantRemoved []string
		unchanged   bool
		wantErr     string
	}{
		{name: "CUDA image on an ordinary pod", env: []string{"NVIDIA_VISIBLE_DEVICES=all", "CUDA_VERSION=12.4.1"}, want: "void"},
		{name: "pod names a neighbour's GPU", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-b"}, want: "void"},
		{name: "device plugin's grant kept", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-a"}, granted: []string{"GPU-a"}, unchanged: true},
		{name: "grant named as a CDI device", env: []string{"NVIDIA_VISIBLE_DEVICES=k8s.device-plugin.nvidia.com/gpu=GPU-a"}, granted: []string{"GPU-a"}, unchanged: true},
		{name: "whole-GPU pod asking for all gets its one", env: []string{"NVIDIA_VISIBLE_DEVICES=all"}, granted: []string{"GPU-a"}, want: "GPU-a"},
		{name: "one granted, two named", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b"}, granted: []string{"GPU-a"}, want: "GPU-a"},
		{name: "an index is not the grant", env: []string{"NVIDIA_VISIBLE_DEVICES=0"}, granted: []string{"GPU-a"}, want: "GPU-a"},
		{name: "shared replicas name their GPU once", env: []string{"NVIDIA_VISIBLE_DEVICES=all"}, granted: []string{"GPU-a::0", "GPU-a::3"}, want: "GPU-a"},
		{name: "replica grant, plugin wrote the GPU", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-a"}, granted: []string{"GPU-a::1"}, unchanged: true},
		{name: "void and none ask for nothing", env: []string{"NVIDIA_VISIBLE_DEVICES=void"}, unchanged: true},
		{name: "none keeps the driver tools", env: []string{"NVIDIA_VISIBLE_DEVICES=none"}, unchanged: true},
		{name: "unset on a modern image is no GPU", env: []string{"CUDA_VERSION=12.4.1", "NVIDIA_REQUIRE_CUDA=cuda>=12.4"}, unchanged: true},
		{name: "unset on a legacy image is all", env: []string{"CUDA_VERSION=10.0"}, want: "void"},
		{name: "unset on a legacy image with a grant", env: []string{"CUDA_VERSION=10.0"}, granted: []string{"GPU-a"}, want: "GPU-a"},
		{name: "set but empty is no GPU", env: []string{"NVIDIA_VISIBLE_DEVICES=", "CUDA_VERSION=10.0"}, unchanged: true},
		{name: "no CUDA at all", env: []string{"HOME=/root"}, unchanged: true},
		{name: "a first copy the runtime overrides is replaced", env: []string{"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=GPU-a"}, granted: []string{"GPU-a"}, want: "GPU-a"},
		{name: "a last copy no adjustment can replace", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_VISIBLE_DEVICES=all"}, granted: []string{"GPU-a"},
			wantErr: `NVIDIA_VISIBLE_DEVICES is set more than once ("GPU-a,all"), and the runtime keeps the last value, "all", over any change`},
		{
			name: "forged volume-mount request removed", env: []string{"NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"},
			mounts:  []*nriapi.Mount{devMount("/var/run/nvidia-container-devices/all"), devMount("/var/run/nvidia-container-devices/GPU-a")},
			granted: []string{"GPU-a"}, want: "GPU-a", wantRemoved: []string{"/var/run/nvidia-container-devices/all"},
		},
		{
			name: "granted volume-mount and CDI-mount requests kept", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-a"},
			mounts: []*nriapi.Mount{
				devMount("/var/run/nvidia-container-devices/GPU-a"),
				devMount("/var/run/nvidia-container-devices/cdi/nvidia.com/gpu/GPU-a"),
				devMount("/var/run/nvidia-container-devices/imex/3"),
				{Source: "/data", Destination: "/var/run/nvidia-container-devices/all"}, // not /dev/null: not a request
			},
			granted: []string{"GPU-a"}, unchanged: true,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			adj, note, err := Police(tc.env, tc.mounts, tc.granted)
			if tc.wantErr != "" || err != nil {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || tc.wantErr == "" {
					t.Fatalf("error %v, want one saying %q", err, tc.wantErr)
				}
				return
			}
			if tc.unchanged {
				if adj != nil {
					t.Fatalf("changed a container that asks for no more than its grant: %v (%s)", adj.GetEnv(), note)
				}
				return
			}
			if adj == nil {
				t.Fatal("left the container as it is")
			}
			if note == "" {
				t.Error("no note says what changed")
			}
			got, ok := ApplyEnv(tc.env, adj)["NVIDIA_VISIBLE_DEVICES"]
			if !ok {
				got = "-"
			}
			if got != tc.want {
				t.Errorf("NVIDIA_VISIBLE_DEVICES = %q, want %q", got, tc.want)
			}
			var removed []string
			for _, m := range adj.GetMounts() {
				if dest, ok := nriapi.IsMarkedForRemoval(m.GetDestination()); ok {
					removed = append(removed, dest)
				}
			}
			if !slices.Equal(removed, tc.wantRemoved) {
				t.Errorf("mounts removed %v, want %v", removed, tc.wantRemoved)
			}
			if tc.want != "-" && !strings.Contains(note, tc.want) {
				t.Errorf("note %q does not say what the container now sees", note)
			}
		})
	}
}

func FuzzPolice(f *testing.F) {
	f.Add("all", "GPU-a::1,GPU-b", "/var/run/nvidia-container-devices/cdi/x=y")
	f.Add("GPU-a", "GPU-a", "")
	f.Fuzz(func(t *testing.T, value, granted, mount string) {
		// Twice, as a device plugin's value and a pod's own end up.
		env := []string{"NVIDIA_VISIBLE_DEVICES=" + granted, "NVIDIA_VISIBLE_DEVICES=" + value}
		ids := strings.Split(granted, ",")
		adj, _, err := Police(env, []*nriapi.Mount{{Source: "/dev/null", Destination: mount}}, ids)
		if err != nil {
			return // refused: it does not start
		}
		got := ApplyEnv(env, adj)["NVIDIA_VISIBLE_DEVICES"]
		// Whatever the container asked for, it now names only granted GPUs.
		if bad := ungranted(strings.Split(got, ","), grantedIDs(ids)); len(bad) > 0 {
			t.Fatalf("value %q granted %q: the container still names %v", value, granted, bad)
		}
	})
}

func TestCheckMPSClientUser(t *testing.T) {
	uid := func(n uint32) *uint32 { return &n }
	allow := Config{AllowRootMPSClients: true}
	for _, tc := range []struct {
		name   string
		uid    *uint32
		userNS bool
		cfg    Config
		refuse bool
	}{
		{"root on the host", uid(0), false, Config{}, true},
		{"an ordinary user", uid(1000), false, Config{}, false},
		{"root in a user namespace", uid(0), true, Config{}, false},
		{"unknown (runtime did not say)", nil, false, Config{}, false},
		{"root, allowed by the admin", uid(0), false, allow, false},
	} {
		err := CheckMPSClientUser(tc.uid, tc.userNS, tc.cfg)
		if (err != nil) != tc.refuse {
			t.Errorf("%s: %v, want refused %v", tc.name, err, tc.refuse)
		}
		if err != nil && !strings.Contains(err.Error(), "--allow-root-mps-clients") {
			t.Errorf("%s: the error does not say how to proceed: %v", tc.name, err)
		}
	}
}

// NamesGPUs, which decides whether a grant is read at all, is exactly
// whether Police, granting nothing, would change the container.
func TestNamesGPUsIsWhatPoliceWouldChange(t *testing.T) {
	envs := [][]string{
		nil, {"PATH=/bin"}, {"NVIDIA_VISIBLE_DEVICES=all"}, {"NVIDIA_VISIBLE_DEVICES=void"}, {"NVIDIA_VISIBLE_DEVICES=none"},
		{"NVIDIA_VISIBLE_DEVICES="}, {"NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b"}, {"NVIDIA_VISIBLE_DEVICES=0"},
		{"NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=all"}, {"CUDA_VERSION=12.4"},
		{"CUDA_VERSION=12.4", "NVIDIA_REQUIRE_CUDA=cuda>=12"}, {"CUDA_VERSION=12.4", "NVIDIA_VISIBLE_DEVICES=void"},
		{"NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=GPU-a"},
	}
	mounts := [][]*nriapi.Mount{nil,
		{{Source: "/dev/null", Destination: "/var/run/nvidia-container-devices/GPU-a"}},
		{{Source: "/dev/null", Destination: "/var/run/nvidia-container-devices/void"}},
		{{Source: "/dev/null", Destination: "/var/run/nvidia-container-devices/imex/channel0"}},
		{{Source: "/data", Destination: "/var/run/nvidia-container-devices/GPU-a"}},
	}
	for _, env := range envs {
		for _, m := range mounts {
			adj, _, err := Police(env, m, nil)
			if want := adj != nil || err != nil; NamesGPUs(env, m) != want {
				t.Errorf("env %q, mounts %v: NamesGPUs %v, Police changes %v", env, m, !want, want)
			}
		}
	}
}
