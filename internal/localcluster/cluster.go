// Package localcluster runs gpufrac's whole stack on this machine, on
// loopback: the real etcd and kube-apiserver (with RBAC and admission),
// the admission webhook with a generated CA, kube-controller-manager with
// the workload controllers (Deployments, StatefulSets, DaemonSets, Jobs,
// CronJobs, claim templates), `gpufrac scheduler`, one `gpufrac
// node-agent` per node in GPU-simulation mode, `gpufrac dashboard`, and
// KWOK as the nodes' kubelets: bound pods become Running (no container
// runs), a Job's pods complete, and deleted pods go away.
package localcluster

import (
	"context"
	"crypto/tls"
	_ "embed"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/textlogger"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/yaml"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/internal/controlplane"
	"github.com/gpufrac/gpufrac/internal/runner"
	"github.com/gpufrac/gpufrac/pkg/admission"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/node/inventory"
)

// Options say what cluster to run.
type Options struct {
	// Dir holds the kubeconfig, logs, state and the pid file (DefaultDir
	// unless --dir names another).
	Dir string
	// Nodes is how many GPU nodes to simulate.
	Nodes int
	// Machine is the go-nvml mock machine each node has (dgxh100, ...).
	Machine string
	// Binary is the gpufrac binary the scheduler and agents run from.
	Binary string
	// Root is the repository, for deploy/ and bin/kube.
	Root string
	// Progress receives one line per step, with its time.
	Progress io.Writer
	// Dashboard is the address the dashboard should serve on (host:port);
	// when it is "" or taken, a free loopback port.
	Dashboard string
	// Shapes, when set, are the simulated nodes, one each, and Nodes and
	// Machine are unused: a trace's nodes, with their own CPU, memory and
	// GPUs, for replaying the trace live.
	Shapes []NodeShape
	// Policy, when set, is the scheduler's placement policy instead of
	// the one in deploy/scheduler/config.yaml.
	Policy string
	// DRAStandingGPUs, when not 0, runs each node agent's DRA driver
	// (--dra) with that many GPUs held for shares (-1: all of them), so
	// that ResourceClaims of gpu.gpufrac.io share GPUs with annotation
	// pods. Whole-GPU pods cannot be given those GPUs.
	DRAStandingGPUs int
	// SchedulerReplicas, when above 1, runs that many schedulers under
	// leader election (deploy/scheduler/config.yaml's Lease), as the
	// chart does: scheduler, scheduler-2, ...
	SchedulerReplicas int
	// WebhookReplicas, when not 0, runs the admission webhook as that
	// many `gpufrac webhook` processes (webhook-1, ...) behind a proxy
	// that passes over a dead one, as a Service does, instead of in this
	// process.
	WebhookReplicas int
	// APIProxy puts a Proxy between kube-apiserver and every component
	// (Cluster.APIProxy), so that a soak can cut their connections or
	// slow them; the admin's own connection (Admin, the kubeconfig) goes
	// straight to kube-apiserver.
	APIProxy bool
}

// NodeShape is one simulated node: its name, allocatable CPU, memory and
// pods, and its GPUs as a --simulate-gpus machine.
type NodeShape struct {
	Name      string
	CPUMilli  int64
	MemoryMiB int64
	Pods      int64
	Machine   string
	gpus      int
}

// Cluster is a running local cluster.
type Cluster struct {
	opts  Options
	cp    *controlplane.ControlPlane
	Admin kubernetes.Interface
	// AdminConfig is Admin's connection, for clients of other kinds.
	AdminConfig *rest.Config
	Kubeconfig  string
	// DashboardURL is where the dashboard serves.
	DashboardURL string
	// APIProxy stands between kube-apiserver and the components
	// (Options.APIProxy), nil otherwise; WebhookProxy between
	// kube-apiserver and the webhook replicas (Options.WebhookReplicas).
	APIProxy, WebhookProxy *Proxy
	// procs are the processes it runs, etcd and kube-apiserver first.
	// procMu orders the changes to them once Up has returned: a soak
	// kills and starts components from one goroutine and starts again
	// those that exited from another.
	procMu   sync.Mutex
	procs    []*runner.Process
	stopHook context.CancelFunc
	hookDone chan error
}

const (
	schedulerUser = admission.DefaultSchedulerUser
	agentUser     = "system:serviceaccount:gpufrac-system:gpufrac-node-agent"
	dashboardUser = "system:serviceaccount:gpufrac-system:gpufrac-dashboard"
	webhookUser   = "system:serviceaccount:gpufrac-system:gpufrac-webhook"
)

// Up starts everything, in order, and returns once every node reports
// itself ready for fractions. On error it stops what it started.
func Up(ctx context.Context, opts Options) (_ *Cluster, err error) {
	// Not a named result: a failed step returns nil, and the deferred
	// Down must still see what was started.
	c := &Cluster{opts: opts}
	defer func() {
		if err != nil {
			c.Down()
		}
	}()
	if err := os.MkdirAll(filepath.Join(opts.Dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	if procs, _, err := ReadPIDs(opts.Dir); err == nil && procs[0].Running() {
		return nil, fmt.Errorf("%v already runs a local cluster in %s: stop it first (gpufrac down --dir %s)", procs[0], opts.Dir, opts.Dir)
	}
	// From now on the pid file names what runs, for `gpufrac down` (also
	// of an up still starting) and `gpufrac wait`; it is marked ready last.
	if err := c.writePIDs(false); err != nil {
		return nil, err
	}
	if len(opts.Shapes) == 0 {
		for i := 1; i <= opts.Nodes; i++ {
			opts.Shapes = append(opts.Shapes, NodeShape{Name: fmt.Sprintf("gpu-node-%d", i), CPUMilli: 64000, MemoryMiB: 512 << 10, Pods: 110, Machine: opts.Machine})
		}
	}
	machines := map[string]int{}
	for i, n := range opts.Shapes {
		if _, ok := machines[n.Machine]; !ok {
			lib, err := inventory.Simulated(n.Machine)
			if err != nil {
				return nil, fmt.Errorf("node %s: %w", n.Name, err)
			}
			inv, err := inventory.Read(lib)
			if err != nil {
				return nil, err
			}
			machines[n.Machine] = len(inv.GPUs)
		}
		opts.Shapes[i].gpus = machines[n.Machine]
	}
	c.opts = opts
	what := "no simulated nodes"
	switch {
	case len(machines) > 1:
		what = fmt.Sprintf("%d nodes of %d kinds of simulated GPUs, one node agent each", len(opts.Shapes), len(machines))
	case len(opts.Shapes) > 0:
		what = fmt.Sprintf("%d nodes of %d simulated %s GPUs, one node agent each", len(opts.Shapes), opts.Shapes[0].gpus, opts.Shapes[0].Machine)
	}
	if err := c.ensureTools(); err != nil {
		return nil, err
	}
	if err := c.step("control plane: etcd and kube-apiserver (RBAC, admission)", func() error { return c.startControlPlane(ctx) }); err != nil {
		return nil, err
	}
	if err := c.step("admission webhook (generated CA, both configurations registered)", func() error { return c.startWebhook(ctx) }); err != nil {
		return nil, err
	}
	if err := c.step("identities and RBAC from deploy/", func() error { return c.applyRBAC(ctx) }); err != nil {
		return nil, err
	}
	if err := c.step(what, func() error { return c.startNodes(ctx) }); err != nil {
		return nil, err
	}
	if err := c.step("fake kubelets (KWOK): bound pods become Running", c.startKwok); err != nil {
		return nil, err
	}
	if err := c.step("scheduler (kube-scheduler + GPUFractions, profile gpufrac)", c.startScheduler); err != nil {
		return nil, err
	}
	if err := c.step("kube-controller-manager (workloads, claims; one credential each)", func() error { return c.startControllerManager(ctx) }); err != nil {
		return nil, err
	}
	if err := c.step("dashboard (read-only: pods, nodes, events, claims)", func() error { return c.startDashboard(ctx) }); err != nil {
		return nil, err
	}
	if err := c.step("waiting for the nodes to report gpu-fractioning.nvidia.com/Ready", func() error { return c.waitReady(ctx) }); err != nil {
		return nil, err
	}
	if opts.DRAStandingGPUs != 0 && len(opts.Shapes) > 0 {
		// Ready is not enough for claims: until the scheduler holds a
		// node's standing GPUs, a share placed there opens an ordinary GPU
		// that the node's DRA driver never offers. Whatever comes next (the
		// demo, the tour, a user's claim) must not depend on which happens
		// first.
		if err := c.step("waiting for every node's standing GPUs to be held and offered to DRA claims", func() error { return c.waitOffered(ctx) }); err != nil {
			return nil, err
		}
	}
	if err := c.writePIDs(true); err != nil {
		return nil, err
	}
	return c, nil
}

// step runs one step and reports it with its duration.
func (c *Cluster) step(what string, do func() error) error {
	start := time.Now()
	fmt.Fprintf(c.opts.Progress, "  %-70s ", what+" …")
	err := do()
	// What the step started is recorded even when it failed, so that
	// `gpufrac down` stops it should this process be killed meanwhile.
	if werr := c.writePIDs(false); err == nil {
		err = werr
	}
	if err != nil {
		fmt.Fprintln(c.opts.Progress, "failed")
		return fmt.Errorf("%s: %w", what, err)
	}
	fmt.Fprintf(c.opts.Progress, "%5.1fs\n", time.Since(start).Seconds())
	return nil
}

// kwokBinary is where `make kwok` puts KWOK.
func (c *Cluster) kwokBinary() string { return filepath.Join(c.opts.Root, "bin", "kwok") }

// ensureTools builds kube-apiserver, kube-controller-manager, etcd and
// KWOK from source (through the Go module proxy, into bin/) when one is
// missing; afterwards they are reused as they are.
func (c *Cluster) ensureTools() error {
	kubeDir, kubeErr := checkout.KubeBinaries()
	if kubeErr == nil {
		_, kubeErr = os.Stat(filepath.Join(kubeDir, "kube-controller-manager"))
	}
	_, kwokErr := os.Stat(c.kwokBinary())
	if kubeErr == nil && kwokErr == nil {
		return nil
	}
	log := filepath.Join(c.opts.Dir, "logs", "build.log")
	return c.step("building kube-apiserver, kube-controller-manager, etcd and KWOK from source (once: about 4.5 min on 2 cores)", func() error {
		out, err := os.Create(log)
		if err != nil {
			return err
		}
		defer func() { _ = out.Close() }()
		cmd := exec.Command("make", "-C", c.opts.Root, "kube-binaries", "kwok")
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("make kube-binaries kwok: %w (see %s)", err, log)
		}
		return nil
	})
}

// startControlPlane runs etcd and kube-apiserver (package controlplane
// says how) like every other component, and waits on their health
// endpoints; the admin's kubeconfig is written for people.
func (c *Cluster) startControlPlane(ctx context.Context) error {
	kubeDir, err := checkout.KubeBinaries()
	if err != nil {
		return err
	}
	// A cluster starts empty: what an earlier up in this directory left
	// (etcd's data, its CA) is not this one's.
	dir := filepath.Join(c.opts.Dir, "control-plane")
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	cp, err := controlplane.New(dir, FreePort, controlplane.Options{})
	if err != nil {
		return err
	}
	c.cp = cp
	if err := c.startBinary(filepath.Join(kubeDir, "etcd"), "etcd", cp.EtcdArgs()...); err != nil {
		return err
	}
	probe := &http.Client{Timeout: 2 * time.Second}
	if err := c.waitServing(ctx, "etcd", probe, cp.EtcdHealthURL(), func(status int, body []byte) bool {
		return status == http.StatusOK && strings.Contains(string(body), `"health":"true"`)
	}); err != nil {
		return err
	}
	if err := c.startBinary(filepath.Join(kubeDir, "kube-apiserver"), "kube-apiserver", cp.APIServerArgs()...); err != nil {
		return err
	}
	cfg, err := cp.Config("gpufrac-admin", "system:masters")
	if err != nil {
		return err
	}
	if probe, err = rest.HTTPClientFor(cfg); err != nil {
		return err
	}
	if err := c.waitServing(ctx, "kube-apiserver", probe, cp.ReadyURL(), func(status int, body []byte) bool {
		return status == http.StatusOK && string(body) == "ok"
	}); err != nil {
		return err
	}
	if c.Admin, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	c.AdminConfig = cfg
	if c.opts.APIProxy {
		if c.APIProxy, err = NewProxy(strings.TrimPrefix(cp.URL(), "https://")); err != nil {
			return err
		}
	}
	kc, err := cp.KubeConfig("gpufrac-admin", "system:masters")
	if err != nil {
		return err
	}
	c.Kubeconfig = filepath.Join(c.opts.Dir, "kubeconfig")
	if err := os.WriteFile(c.Kubeconfig, kc, 0o600); err != nil {
		return err
	}
	// Namespaced objects go to "default" (the demo's among them), which
	// the API server makes just after it is ready.
	return wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := c.Admin.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
}

func (c *Cluster) startWebhook(ctx context.Context) error {
	// The webhook reads as its own service account, with deploy/webhook's
	// RBAC: the nodes' GPU memory and the claims it charges to quota.
	if err := ApplyRBAC(ctx, c.Admin, filepath.Join(c.opts.Root, "deploy", "webhook", "server.yaml")); err != nil {
		return err
	}
	if c.opts.WebhookReplicas > 0 {
		return c.startWebhookReplicas(ctx)
	}
	cfg, err := c.cp.Config(webhookUser, serviceAccountGroups...)
	if err != nil {
		return err
	}
	reader, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	charger, synced := admission.NewCharger(ctx, reader)
	if !toolscache.WaitForCacheSync(ctx.Done(), synced) {
		return fmt.Errorf("admission webhook: the nodes were not read: %w", ctx.Err())
	}
	// Served here, on a loopback port, with a certificate of the cluster's
	// CA, which both configurations name as their bundle.
	port, err := FreePort()
	if err != nil {
		return err
	}
	certDir := filepath.Join(c.opts.Dir, "webhook")
	if err := writeServingCert(c.cp.CA, certDir); err != nil {
		return err
	}
	if err := installWebhooks(ctx, c.Admin, filepath.Join(c.opts.Root, "deploy", "webhook", "configurations.yaml"), fmt.Sprintf("https://127.0.0.1:%d", port), c.cp.CA.PEM); err != nil {
		return err
	}
	srv := admission.NewServer(admission.ServerOptions{
		Host: "127.0.0.1", Port: port, CertDir: certDir,
		// KAI's scheduler is trusted too: the local cluster plays KAI's
		// side in the interop scenarios (a pod KAI admits and binds).
		Identity: admission.Identity{Users: []string{schedulerUser}, NodeAgents: []string{agentUser}, Schedulers: []string{"gpufrac", "kai-scheduler"}}, SchedulerName: "gpufrac",
		Charger: charger,
	})
	// The webhook runs in this process; its log goes to a file like the
	// other components', not over the progress lines.
	logFile, err := os.Create(filepath.Join(c.opts.Dir, "logs", "webhook.log"))
	if err != nil {
		return err
	}
	logger := textlogger.NewLogger(textlogger.NewConfig(textlogger.Output(logFile)))
	ctrllog.SetLogger(logger)
	hookCtx, cancel := context.WithCancel(klog.NewContext(ctx, logger))
	c.stopHook, c.hookDone = cancel, make(chan error, 1)
	go func() { c.hookDone <- srv.Start(hookCtx); _ = logFile.Close() }()
	return wait.PollUntilContextTimeout(hookCtx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return srv.StartedChecker()(nil) == nil, nil
	})
}

// startWebhookReplicas runs the webhook as WebhookReplicas processes of
// `gpufrac webhook`, each on a port of its own with the same certificate,
// behind WebhookProxy, which both configurations call; it returns once
// each answers its readiness check.
func (c *Cluster) startWebhookReplicas(ctx context.Context) error {
	kc, err := c.kubeconfigFor("webhook", webhookUser, serviceAccountGroups...)
	if err != nil {
		return err
	}
	certDir := filepath.Join(c.opts.Dir, "webhook")
	if err := writeServingCert(c.cp.CA, certDir); err != nil {
		return err
	}
	var backends, health []string
	for i := 1; i <= c.opts.WebhookReplicas; i++ {
		port, err := FreePort()
		if err != nil {
			return err
		}
		hport, err := FreePort()
		if err != nil {
			return err
		}
		name := fmt.Sprintf("webhook-%d", i)
		if err := c.start(name, "webhook", "--kubeconfig", kc, "--host", "127.0.0.1", "--port", strconv.Itoa(port), "--cert-dir", certDir,
			"--health-addr", fmt.Sprintf("127.0.0.1:%d", hport), "--scheduler-user", schedulerUser, "--node-agent-user", agentUser,
			"--scheduler-name", "gpufrac", "--trusted-scheduler", "gpufrac,kai-scheduler"); err != nil {
			return err
		}
		backends = append(backends, fmt.Sprintf("127.0.0.1:%d", port))
		health = append(health, name, fmt.Sprintf("http://127.0.0.1:%d/readyz", hport))
	}
	for i := 0; i < len(health); i += 2 {
		if err := c.waitServing(ctx, health[i], &http.Client{Timeout: 2 * time.Second}, health[i+1],
			func(status int, _ []byte) bool { return status == http.StatusOK }); err != nil {
			return err
		}
	}
	if c.WebhookProxy, err = NewProxy(backends...); err != nil {
		return err
	}
	return installWebhooks(ctx, c.Admin, filepath.Join(c.opts.Root, "deploy", "webhook", "configurations.yaml"), "https://"+c.WebhookProxy.Addr(), c.cp.CA.PEM)
}

func (c *Cluster) applyRBAC(ctx context.Context) error {
	files := []string{"node-agent/node-agent.yaml", "scheduler/scheduler.yaml", "dashboard/dashboard.yaml"}
	if c.opts.DRAStandingGPUs != 0 {
		files = append(files, "dra/node-agent-rbac.yaml", "dra/deviceclass.yaml")
	}
	for _, f := range files {
		if err := ApplyRBAC(ctx, c.Admin, filepath.Join(c.opts.Root, "deploy", f)); err != nil {
			return err
		}
	}
	return nil
}

// serviceAccountGroups are the groups a gpufrac component's service
// account is in; deploy/'s RBAC grants it what it may do.
var serviceAccountGroups = []string{"system:serviceaccounts", "system:serviceaccounts:gpufrac-system", "system:authenticated"}

// kubeconfigFor writes a kubeconfig for a component's identity: a client
// certificate for user in groups, and nothing more.
func (c *Cluster) kubeconfigFor(name, user string, groups ...string) (string, error) {
	kc, err := c.cp.KubeConfig(user, groups...)
	if err != nil {
		return "", err
	}
	if c.APIProxy != nil {
		cfg, err := clientcmd.Load(kc)
		if err != nil {
			return "", err
		}
		for _, cluster := range cfg.Clusters {
			cluster.Server = "https://" + c.APIProxy.Addr()
		}
		if kc, err = clientcmd.Write(*cfg); err != nil {
			return "", err
		}
	}
	path := filepath.Join(c.opts.Dir, name+".kubeconfig")
	return path, os.WriteFile(path, kc, 0o600)
}

// startNodes creates the Node objects (what a kubelet and the device
// plugin would report) and starts one node agent per node.
func (c *Cluster) startNodes(ctx context.Context) error {
	kc, err := c.kubeconfigFor("node-agent", agentUser, serviceAccountGroups...)
	if err != nil {
		return err
	}
	for _, shape := range c.opts.Shapes {
		if err := c.createNode(ctx, shape); err != nil {
			return err
		}
		state := filepath.Join(c.opts.Dir, "nodes", shape.Name)
		if err := os.MkdirAll(state, 0o755); err != nil {
			return err
		}
		args := []string{"node-agent", "--node-name", shape.Name, "--kubeconfig", kc,
			"--simulate-gpus", shape.Machine, "--publish-gpu-labels", "--state-dir", state,
			"--health-addr", "", "--metrics-addr", "", "--resync-period", "2s", "--usage-publish-period", "2s", "--hook-path", "",
			// No containers run here, so no MPS daemon either.
			"--mps-pipe-dir", ""}
		if c.opts.DRAStandingGPUs != 0 {
			args = append(args, "--dra", "--dra-standing-gpus", strconv.Itoa(c.opts.DRAStandingGPUs))
		}
		if err := c.start("node-agent-"+shape.Name, args...); err != nil {
			return err
		}
	}
	return nil
}

// createNode creates a simulated node's Node object, as its kubelet
// registers it.
func (c *Cluster) createNode(ctx context.Context, shape NodeShape) error {
	labels := map[string]string{"kubernetes.io/hostname": shape.Name, "gpufrac.io/simulated": "true"}
	res := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(shape.CPUMilli, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(shape.MemoryMiB<<20, resource.BinarySI),
		corev1.ResourcePods:   *resource.NewQuantity(shape.Pods, resource.DecimalSI),
	}
	return CreateNodeWith(ctx, c.Admin, shape.Name, shape.gpus, res, labels)
}

// RemoveNode takes a simulated node out as a machine that goes away does:
// its agent stops (SIGKILL) and its Node object is deleted; the pod
// garbage collector then deletes the pods bound to it. AddNode brings it
// back.
func (c *Cluster) RemoveNode(ctx context.Context, name string) error {
	if err := c.Stop("node-agent-" + name); err != nil {
		return err
	}
	return c.Admin.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
}

// AddNode registers a node RemoveNode took out again, with the same
// GPUs, and starts its agent (with its state directory as it was, as a
// rebooted machine's disk).
func (c *Cluster) AddNode(ctx context.Context, name string) error {
	for _, shape := range c.opts.Shapes {
		if shape.Name == name {
			if err := c.createNode(ctx, shape); err != nil {
				return err
			}
			return c.Start("node-agent-" + name)
		}
	}
	return fmt.Errorf("no simulated node %q", name)
}

// CreateNode creates a Node object as a kubelet with the device plugin
// would report it, with no kubelet behind it: Ready, 64 CPUs, 512Gi, 110
// pods and gpus nvidia.com/gpu, with the given labels and any further
// conditions (what a node agent would publish).
func CreateNode(ctx context.Context, client kubernetes.Interface, name string, gpus int, labels map[string]string, conditions ...corev1.NodeCondition) error {
	res := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("64"),
		corev1.ResourceMemory: resource.MustParse("512Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	return CreateNodeWith(ctx, client, name, gpus, res, labels, conditions...)
}

// CreateNodeWith is CreateNode with the node's CPU, memory and pods given.
func CreateNodeWith(ctx context.Context, client kubernetes.Interface, name string, gpus int, res corev1.ResourceList, labels map[string]string, conditions ...corev1.NodeCondition) error {
	node, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	res = res.DeepCopy()
	res[api.ResourceGPU] = *resource.NewQuantity(int64(gpus), resource.DecimalSI)
	if _, ok := api.GPUMemoryMiB(labels); ok {
		maps.Copy(res, api.ChargeCapacityList()) // as the node agent advertises it (publish.Apply)
	}
	node.Status.Capacity, node.Status.Allocatable = res, res
	node.Status.Conditions = append([]corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "Simulated",
		Message: "a Node object with no kubelet", LastHeartbeatTime: metav1.Now()}}, conditions...)
	_, err = client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
	return err
}

//go:embed kwok.yaml
var kwokStages []byte

// startKwok runs KWOK as the kubelet of every simulated node. It acts as
// the cluster admin: it stands in for the kubelets, which are trusted.
func (c *Cluster) startKwok() error {
	stages := filepath.Join(c.opts.Dir, "kwok.yaml")
	if err := os.WriteFile(stages, kwokStages, 0o644); err != nil {
		return err
	}
	return c.startBinary(c.kwokBinary(), "kwok", "--kubeconfig", c.Kubeconfig, "--config", stages,
		"--manage-nodes-with-label-selector", "gpufrac.io/simulated=true", "--node-lease-duration-seconds", "40")
}

func (c *Cluster) startScheduler() error {
	kc, err := c.kubeconfigFor("scheduler", schedulerUser, serviceAccountGroups...)
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join(c.opts.Root, "deploy", "scheduler", "config.yaml"))
	if err != nil {
		return err
	}
	var cfg map[string]any
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		return err
	}
	conn, _ := cfg["clientConnection"].(map[string]any)
	if conn == nil {
		conn = map[string]any{}
	}
	conn["kubeconfig"] = kc
	cfg["clientConnection"] = conn
	if c.opts.Policy != "" {
		if err := setPolicy(cfg, c.opts.Policy); err != nil {
			return err
		}
	}
	if c.opts.SchedulerReplicas <= 1 {
		cfg["leaderElection"] = map[string]any{"leaderElect": false}
		// One replica, no election: it writes outside its scheduling
		// cycle (reservation pods, resizes) itself.
		if err := setPluginArg(cfg, "leaderLease", nil); err != nil {
			return err
		}
	}
	// Else deploy/'s election as it is: the Lease its RBAC names, and
	// delayCacheUntilActive (a standby's informers, and so its plugin's
	// collector, start only once it leads).
	out, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	path := filepath.Join(c.opts.Dir, "scheduler-config.yaml")
	if err := os.WriteFile(path, out, 0o600); err != nil {
		return err
	}
	for i := 1; i <= max(c.opts.SchedulerReplicas, 1); i++ {
		name := "scheduler"
		if i > 1 {
			name = fmt.Sprintf("scheduler-%d", i)
		}
		if err := c.start(name, "scheduler", "--config", path, "--secure-port", "0"); err != nil {
			return err
		}
	}
	return nil
}

// Controllers are the kube-controller-manager controllers the local
// cluster runs: those that turn what users apply (Deployments, ReplicaSets,
// StatefulSets, DaemonSets, Jobs, CronJobs, DRA claim templates) into pods
// and claims, the garbage collector (a deleted Deployment's ReplicaSets and
// pods), the namespace controller (a deleted namespace's contents), and
// what those workloads usually come with: PodDisruptionBudgets' status
// (without it an eviction, the node agent's included, is refused under
// any budget), finished Jobs' TTL, a Service's EndpointSlices, and
// ResourceQuota's usage (its admission refuses every pod in a namespace
// whose quota no controller has counted yet; a namespace's GPU memory
// budget is one, docs/security.md).
// Left out: the node lifecycle controller (KWOK and the node agents keep
// the nodes' status), the service-account and token controllers (the
// ServiceAccount admission plugin is off: no kubelet would mount a token),
// certificates, IPAM, volumes and cloud controllers (nothing here uses
// them).
var Controllers = []string{
	"deployment-controller", "replicaset-controller", "statefulset-controller", "daemonset-controller",
	"job-controller", "cronjob-controller", "garbage-collector-controller", "namespace-controller",
	"resourceclaim-controller", "disruption-controller", "ttl-after-finished-controller", "endpointslice-controller",
	"resourcequota-controller", "pod-garbage-collector-controller",
}

// controllerManagerUser is kube-controller-manager's own identity, with
// the RBAC of controller-manager-rbac.yaml: list and watch (its
// informers), and the controllers' service accounts and tokens in
// kube-system. Not system:kube-controller-manager, whose bootstrap role
// grants more (Secrets, reviews, leases) than this cluster's process
// uses. With --use-service-account-credentials every controller acts as
// its own service account, with only its bootstrap role
// (system:controller:deployment-controller, ...), as on a kubeadm cluster.
const controllerManagerUser = "gpufrac:local-kube-controller-manager"

//go:embed controller-manager-rbac.yaml
var controllerManagerRBAC []byte

// startControllerManager runs kube-controller-manager (built from source
// into bin/kube) and waits until each of its controllers has started:
// until its /healthz/<controller> check answers.
func (c *Cluster) startControllerManager(ctx context.Context) error {
	kubeDir, err := checkout.KubeBinaries()
	if err != nil {
		return err
	}
	bin := filepath.Join(kubeDir, "kube-controller-manager")
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("kube-controller-manager not in %s: run `make kube-binaries`", kubeDir)
	}
	if err := applyRBACDocs(ctx, c.Admin, "controller-manager-rbac.yaml", controllerManagerRBAC); err != nil {
		return err
	}
	kc, err := c.kubeconfigFor("controller-manager", controllerManagerUser, "system:authenticated")
	if err != nil {
		return err
	}
	port, err := FreePort()
	if err != nil {
		return err
	}
	certs := filepath.Join(c.opts.Dir, "controller-manager")
	if err := c.startBinary(bin, "controller-manager",
		// No delegated authentication or authorization: nothing but this
		// process's health probe (an always-allowed path) calls its port.
		"--kubeconfig", kc,
		"--use-service-account-credentials", "--controllers", strings.Join(Controllers, ","),
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(port), "--cert-dir", certs,
	); err != nil {
		return err
	}
	// A controller's check joins /healthz once the controller is built;
	// the serving certificate is self-signed and only this process asks.
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // loopback health probe of a child process
	waiting := "its /healthz"
	err = c.waitServing(ctx, "controller-manager", client, fmt.Sprintf("https://127.0.0.1:%d/healthz?verbose", port), func(_ int, body []byte) bool {
		for _, name := range Controllers {
			if waiting = name; !strings.Contains(string(body), "[+]"+name+" ok") {
				return false
			}
		}
		return true
	})
	if err != nil && c.exited("controller-manager") == nil {
		return fmt.Errorf("%s has not started: %w (see %s)", waiting, err, filepath.Join(c.opts.Dir, "logs", "controller-manager.log"))
	}
	return err
}

// startDashboard runs `gpufrac dashboard` as its own service account
// (deploy/dashboard's read-only RBAC) and waits until it serves.
func (c *Cluster) startDashboard(ctx context.Context) error {
	kc, err := c.kubeconfigFor("dashboard", dashboardUser, serviceAccountGroups...)
	if err != nil {
		return err
	}
	addr := c.opts.Dashboard
	if addr != "" {
		// Taken (another up, or anything else): a free port rather than no
		// dashboard; the URL is printed either way.
		if l, err := net.Listen("tcp", addr); err != nil {
			fmt.Fprintf(c.opts.Progress, "(%s is taken: a free port) ", addr)
			addr = ""
		} else {
			_ = l.Close()
		}
	}
	if addr == "" {
		port, err := FreePort()
		if err != nil {
			return err
		}
		addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	}
	if err := c.start("dashboard", "dashboard", "--kubeconfig", kc, "--listen", addr); err != nil {
		return err
	}
	c.DashboardURL = "http://" + addr + "/"
	return c.waitServing(ctx, "dashboard", &http.Client{Timeout: 2 * time.Second}, c.DashboardURL+"healthz",
		func(status int, _ []byte) bool { return status == http.StatusOK })
}

// waitServing polls url, for up to a minute, until ready accepts the
// answer (its status and body); it fails at once when the child process
// name has exited. Until the child listens, a refused connection is
// simply asked again.
func (c *Cluster) waitServing(ctx context.Context, name string, client *http.Client, url string, ready func(status int, body []byte) bool) error {
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.exited(name); err != nil {
			return false, err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return false, nil //nolint:nilerr // not serving yet: ask again
		}
		body, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return false, nil //nolint:nilerr // a cut-off answer: ask again
		}
		return ready(resp.StatusCode, body), nil
	})
}

// FreePort is a loopback TCP port nobody listens on now.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// exited is an error when the named child process has exited, naming its
// log.
func (c *Cluster) exited(name string) error {
	for _, p := range c.procs {
		if p.Name == name {
			return p.Exited()
		}
	}
	return nil
}

// start runs a gpufrac subcommand as a child process, logging to
// logs/<name>.log.
func (c *Cluster) start(name string, args ...string) error {
	return c.startBinary(c.opts.Binary, name, args...)
}

// startBinary runs bin as the child process name, logging to
// logs/<name>.log; a process of that name is replaced.
func (c *Cluster) startBinary(bin, name string, args ...string) error {
	// Its own process group: a Ctrl-C reaches the parent, which stops the
	// children in order.
	p, err := runner.Start(name, filepath.Join(c.opts.Dir, "logs", name+".log"), nil, bin, args...)
	if err != nil {
		return err
	}
	c.replace(p)
	return nil
}

// replace records p, in the place of a process of its name if there is one.
func (c *Cluster) replace(p *runner.Process) {
	for i, old := range c.procs {
		if old.Name == p.Name {
			c.procs[i] = p
			return
		}
	}
	c.procs = append(c.procs, p)
}

// Nodes are the simulated nodes' names.
func (c *Cluster) Nodes() []string {
	var names []string
	for _, shape := range c.opts.Shapes {
		names = append(names, shape.Name)
	}
	return names
}

// Components lists the child processes by name: node-agent-<node>, kwok,
// scheduler, controller-manager, dashboard.
func (c *Cluster) Components() []string {
	c.procMu.Lock()
	defer c.procMu.Unlock()
	return c.components()
}

func (c *Cluster) components() []string {
	var names []string
	for _, p := range c.procs {
		names = append(names, p.Name)
	}
	return names
}

// Crash kills a component outright (SIGKILL, as an OOM kill or a node
// reboot would) and starts it again with the same arguments, as its
// Deployment or DaemonSet would.
func (c *Cluster) Crash(name string) error {
	c.procMu.Lock()
	defer c.procMu.Unlock()
	for _, p := range c.procs {
		if p.Name != name {
			continue
		}
		p.Kill()
		again, err := p.Restart()
		if err != nil {
			return err
		}
		c.replace(again)
		return c.writePIDs(true) // the new process must be stopped by down too
	}
	return fmt.Errorf("no component %q: one of %v", name, c.components())
}

// Stop kills a component outright (SIGKILL) and leaves it stopped until
// Start or Revive starts it again.
func (c *Cluster) Stop(name string) error {
	c.procMu.Lock()
	defer c.procMu.Unlock()
	for _, p := range c.procs {
		if p.Name == name {
			p.Kill()
			return nil
		}
	}
	return fmt.Errorf("no component %q: one of %v", name, c.components())
}

// Start starts a stopped component again with its arguments; one that
// runs is left alone.
func (c *Cluster) Start(name string) error {
	c.procMu.Lock()
	defer c.procMu.Unlock()
	return c.startAgain(name)
}

func (c *Cluster) startAgain(name string) error {
	for _, p := range c.procs {
		if p.Name != name {
			continue
		}
		if p.Exited() == nil {
			return nil
		}
		again, err := p.Restart()
		if err != nil {
			return err
		}
		c.replace(again)
		return c.writePIDs(true)
	}
	return fmt.Errorf("no component %q: one of %v", name, c.components())
}

// Revive starts again every component that has exited but those named in
// keep, as their Deployments and DaemonSets would (a scheduler that lost
// its lease exits, say), and returns the names of those it started.
func (c *Cluster) Revive(keep ...string) ([]string, error) {
	c.procMu.Lock()
	defer c.procMu.Unlock()
	var started []string
	for _, p := range slices.Clone(c.procs) {
		if p.Exited() == nil || slices.Contains(keep, p.Name) {
			continue
		}
		if err := c.startAgain(p.Name); err != nil {
			return started, err
		}
		started = append(started, p.Name)
	}
	return started, nil
}

func (c *Cluster) waitReady(ctx context.Context) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, p := range c.procs {
			if err := c.exited(p.Name); err != nil {
				return false, err
			}
		}
		nodes, err := c.Admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "gpufrac.io/simulated=true"})
		if err != nil {
			return false, err
		}
		ready := 0
		for _, n := range nodes.Items {
			if cond, ok := api.FractioningCondition(&n); ok && cond.Status == corev1.ConditionTrue {
				ready++
			}
		}
		return ready == len(c.opts.Shapes), nil
	})
}

// waitOffered waits until every simulated node offers DRA claims all the
// GPUs it asks to have held for shares (its api.LabelStandingGPUs): the
// scheduler has made their standing reservation pods, the node agent has
// told it which GPU each holds and published them in the node's
// ResourceSlices. Only then does every share placed on the node join a GPU
// its DRA driver offers.
func (c *Cluster) waitOffered(ctx context.Context) error {
	var behind string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, p := range c.procs {
			if err := c.exited(p.Name); err != nil {
				return false, err
			}
		}
		offered, err := OfferedGPUs(ctx, c.Admin)
		if err != nil {
			return false, err
		}
		for _, shape := range c.opts.Shapes {
			node, err := c.Admin.CoreV1().Nodes().Get(ctx, shape.Name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			want := api.StandingGPUs(node, shape.gpus)
			if !api.StandingLabelled(node) || len(offered[shape.Name]) < want {
				behind = fmt.Sprintf("node %s offers %d of the %d GPUs its label %s asks to have held (unset until its agent publishes it)",
					shape.Name, len(offered[shape.Name]), want, api.LabelStandingGPUs)
				return false, nil
			}
		}
		return true, nil
	})
	if wait.Interrupted(err) && behind != "" {
		return fmt.Errorf("%s: %w (see %s)", behind, err, filepath.Join(c.opts.Dir, "logs"))
	}
	return err
}

// Down is Shutdown for a deferred call: what it could not stop is
// written to the progress output.
func (c *Cluster) Down() {
	if err := c.Shutdown(); err != nil {
		fmt.Fprintf(c.opts.Progress, "  %v\n", err)
	}
}

// Shutdown stops everything in reverse order: the dashboard,
// kube-controller-manager, the scheduler, KWOK and the node agents
// together, then the webhook, kube-apiserver and etcd (stopped under a
// live kube-apiserver, etcd would leave it retrying until its own grace
// ends); each SIGTERM, then SIGKILL after 10 s. A component that died or
// was replaced meanwhile is simply gone. The error names what not even
// SIGKILL stopped, and the pid file is then kept for `gpufrac down`.
func (c *Cluster) Shutdown() error {
	components, apiserver, etcd := inStopOrder(c.procs, func(p *runner.Process) string { return p.Name })
	runner.Stop(10*time.Second, components...)
	if c.stopHook != nil {
		c.stopHook()
		if err := <-c.hookDone; err != nil {
			fmt.Fprintf(c.opts.Progress, "  webhook: %v\n", err)
		}
		c.stopHook = nil
	}
	if c.WebhookProxy != nil {
		_ = c.WebhookProxy.Close()
	}
	runner.Stop(10*time.Second, apiserver...)
	runner.Stop(10*time.Second, etcd...)
	if c.APIProxy != nil {
		_ = c.APIProxy.Close()
	}
	var left []string
	for _, p := range c.procs {
		if proc, ok := procOf(p.PID(), p.Name); ok && proc.Running() {
			left = append(left, proc.String())
		}
	}
	c.procs = nil
	if len(left) > 0 {
		return fmt.Errorf("could not stop %s: still running after SIGKILL", strings.Join(left, ", "))
	}
	_ = os.Remove(filepath.Join(c.opts.Dir, pidFile))
	return nil
}

// setPolicy sets the GPUFractions plugin's policy in a
// KubeSchedulerConfiguration read as YAML.
func setPolicy(cfg map[string]any, policy string) error {
	return setPluginArg(cfg, "policy", policy)
}

// setPluginArg sets one of the GPUFractions plugin's args in a
// KubeSchedulerConfiguration read as YAML; a nil value removes it.
func setPluginArg(cfg map[string]any, key string, value any) error {
	profiles, _ := cfg["profiles"].([]any)
	for _, p := range profiles {
		profile, _ := p.(map[string]any)
		plugins, _ := profile["pluginConfig"].([]any)
		for _, pc := range plugins {
			pc, _ := pc.(map[string]any)
			if pc["name"] != "GPUFractions" {
				continue
			}
			args, _ := pc["args"].(map[string]any)
			if args == nil {
				args = map[string]any{}
				pc["args"] = args
			}
			if value == nil {
				delete(args, key)
			} else {
				args[key] = value
			}
			return nil
		}
	}
	return fmt.Errorf("deploy/scheduler/config.yaml has no GPUFractions pluginConfig to set %s %v in", key, value)
}
